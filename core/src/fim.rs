//! Fill-in-the-middle: the prompt a code model completes the middle of a file from, as llama.cpp's
//! `/infill` builds it, and the line rules an editor's completion stops by.
//!
//! The prompt is `[extra] <PRE> prefix prompt <SUF> suffix <MID>`: the model writes the middle and
//! ends it with its end-of-text (or a FIM pad / file separator token). `extra` is repository context
//! (other files, or snippets of them): `<repo_name>myproject\n` then `<file_sep>name\ntext` per
//! chunk where the model has those tokens, then `<file_sep>filename\n` for the file being edited
//! (llama.cpp's placeholders, kept so that a model sees what it sees there).

/// A vocabulary's FIM tokens; present when it has at least the prefix, suffix and middle tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FimTokens {
    pub prefix: u32,
    pub suffix: u32,
    pub middle: u32,
    pub pad: Option<u32>,
    pub repo_name: Option<u32>,
    pub file_sep: Option<u32>,
}

/// Spellings of each FIM token: Qwen2.5-Coder, StarCoder/DeepSeek-style, CodeLlama, CodeGemma.
const PREFIX: &[&str] =
    &["<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "▁<PRE>", "<|fim▁begin|>"];
const SUFFIX: &[&str] =
    &["<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>", "▁<SUF>", "<|fim▁hole|>"];
const MIDDLE: &[&str] =
    &["<|fim_middle|>", "<fim_middle>", "<fim-middle>", "▁<MID>", "<|fim▁end|>"];
const PAD: &[&str] = &["<|fim_pad|>", "<fim_pad>", "<fim-pad>"];
const REPO_NAME: &[&str] = &["<|repo_name|>", "<repo_name>", "<reponame>"];
const FILE_SEP: &[&str] = &["<|file_sep|>", "<file_sep>"];

/// Tokens that end a middle besides end-of-text, as llama.cpp treats them (end-of-generation).
pub const END_TOKENS: &[&str] = &["<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"];

/// Written between chunks of context where the model has no file separator (llama.cpp's).
pub const SNIPPET_SEPARATOR: &str = "\n\n--- snippet ---\n\n";
/// The repository line and the edited file's name line of the extra context (llama.cpp's).
pub const REPO_LINE: &str = "myproject\n";
pub const FILE_LINE: &str = "filename\n";

impl FimTokens {
    /// The FIM tokens of a vocabulary, by their spelling (`id` looks a token's text up).
    pub fn find(id: impl Fn(&str) -> Option<u32>) -> Option<Self> {
        let any = |names: &[&str]| names.iter().find_map(|n| id(n));
        Some(Self {
            prefix: any(PREFIX)?,
            suffix: any(SUFFIX)?,
            middle: any(MIDDLE)?,
            pad: any(PAD),
            repo_name: any(REPO_NAME),
            file_sep: any(FILE_SEP),
        })
    }
}

/// One chunk of extra context: the tokens of its header (`name\n` after a file separator, or the
/// snippet separator) and of its text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtraChunk {
    pub header: Vec<u32>,
    pub text: Vec<u32>,
}

/// A FIM request's parts, tokenized (without special tokens).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InfillParts {
    pub prefix: Vec<u32>,
    /// Text the middle starts with (llama.cpp's `prompt`: the line up to the cursor), after the prefix.
    pub prompt: Vec<u32>,
    pub suffix: Vec<u32>,
    pub extra: Vec<ExtraChunk>,
    /// [`REPO_LINE`] and [`FILE_LINE`], tokenized; used only with `extra` and the matching tokens.
    pub repo_line: Vec<u32>,
    pub file_line: Vec<u32>,
}

/// How much of each part a prompt takes, as llama.cpp's `/infill` fits it: the prefix's last
/// 3/4 of `batch` tokens, the suffix's first 1/4 (less the prompt), and the extra context's last
/// tokens that leave `batch` and twice the answer free in the context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InfillBudget {
    pub batch: usize,
    pub context: usize,
    pub max_tokens: usize,
}

/// The prompt, and whether a part was cut to fit `budget` (None: nothing is cut).
pub fn infill_prompt(
    fim: &FimTokens,
    parts: &InfillParts,
    budget: Option<InfillBudget>,
) -> (Vec<u32>, bool) {
    let mut extra = Vec::new();
    if !parts.extra.is_empty() {
        if let Some(repo) = fim.repo_name {
            extra.push(repo);
            extra.extend(&parts.repo_line);
        }
        for chunk in &parts.extra {
            extra.extend(fim.file_sep);
            extra.extend(&chunk.header);
            extra.extend(&chunk.text);
        }
        if let Some(sep) = fim.file_sep {
            extra.push(sep);
            extra.extend(&parts.file_line);
        }
    }
    let (prefix_take, suffix_take, extra_take) = match budget {
        None => (parts.prefix.len(), parts.suffix.len(), extra.len()),
        Some(b) => (
            parts.prefix.len().min(3 * (b.batch / 4)),
            parts.suffix.len().min((b.batch / 4).saturating_sub(2 + parts.prompt.len())),
            extra.len().min(b.context.saturating_sub(b.batch + 2 * b.max_tokens)),
        ),
    };
    let truncated = prefix_take < parts.prefix.len()
        || suffix_take < parts.suffix.len()
        || extra_take < extra.len();
    let mut out =
        Vec::with_capacity(extra_take + prefix_take + suffix_take + parts.prompt.len() + 3);
    out.extend(&extra[extra.len() - extra_take..]);
    out.push(fim.prefix);
    out.extend(&parts.prefix[parts.prefix.len() - prefix_take..]);
    out.extend(&parts.prompt);
    out.push(fim.suffix);
    out.extend(&parts.suffix[..suffix_take]);
    out.push(fim.middle);
    (out, truncated)
}

/// llama-server's line rules for editor completions, applied to the text as it streams:
/// - `n_indent`: once a line has ended, a later line indented less than this many spaces or tabs
///   (a blank one included) ends the answer, without that line;
/// - a time limit: once it has passed, the answer ends with the next line end.
///
/// The leading whitespace of each line after the first is held back until the line shows its
/// indentation, so text that the indentation rule cuts is never sent.
#[derive(Debug, Clone, Default)]
pub struct LineLimits {
    n_indent: usize,
    /// Whitespace at the start of the current line, not sent yet (`n_indent` > 0 only).
    held: String,
    /// The text so far ended a line; the current line has shown only whitespace (or nothing).
    at_line_start: bool,
}

/// What to send of a pushed piece, and whether the answer ends there.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LineStep {
    pub emit: String,
    pub stopped: bool,
}

impl LineLimits {
    pub fn new(n_indent: usize) -> Self {
        Self { n_indent, ..Self::default() }
    }

    /// `text` continues the answer; `late`: the time limit has passed.
    pub fn push(&mut self, text: &str, late: bool) -> LineStep {
        let mut emit = String::new();
        for c in text.chars() {
            if self.at_line_start && self.n_indent > 0 {
                if c == ' ' || c == '\t' {
                    self.held.push(c);
                    continue;
                }
                if self.held.chars().count() < self.n_indent {
                    self.held.clear();
                    return LineStep { emit, stopped: true };
                }
                emit.push_str(&std::mem::take(&mut self.held));
            }
            emit.push(c);
            if c == '\n' {
                if late {
                    return LineStep { emit, stopped: true };
                }
                self.at_line_start = true;
            } else {
                self.at_line_start = false;
            }
        }
        LineStep { emit, stopped: false }
    }

    /// What is still held when the answer ends by itself.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen() -> FimTokens {
        FimTokens::find(|t| match t {
            "<|fim_prefix|>" => Some(1),
            "<|fim_suffix|>" => Some(2),
            "<|fim_middle|>" => Some(3),
            "<|fim_pad|>" => Some(4),
            "<|repo_name|>" => Some(5),
            "<|file_sep|>" => Some(6),
            _ => None,
        })
        .unwrap()
    }

    #[test]
    fn tokens_are_found_by_spelling_and_all_three_are_needed() {
        let fim = qwen();
        assert_eq!((fim.prefix, fim.suffix, fim.middle, fim.file_sep), (1, 2, 3, Some(6)));
        let starcoder = FimTokens::find(|t| {
            ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
                .iter()
                .position(|&n| n == t)
                .map(|i| i as u32 + 10)
        })
        .unwrap();
        assert_eq!((starcoder.prefix, starcoder.middle, starcoder.pad), (10, 12, None));
        assert_eq!(FimTokens::find(|t| (t == "<|fim_prefix|>").then_some(1)), None);
    }

    #[test]
    fn the_prompt_is_prefix_suffix_middle_after_the_repository_context() {
        let fim = qwen();
        let parts = InfillParts {
            prefix: vec![100, 101],
            prompt: vec![102],
            suffix: vec![200],
            ..Default::default()
        };
        assert_eq!(infill_prompt(&fim, &parts, None), (vec![1, 100, 101, 102, 2, 200, 3], false));
        let parts = InfillParts {
            extra: vec![ExtraChunk { header: vec![50], text: vec![51, 52] }],
            repo_line: vec![60],
            file_line: vec![70],
            ..parts
        };
        let (prompt, _) = infill_prompt(&fim, &parts, None);
        assert_eq!(prompt, [5, 60, 6, 50, 51, 52, 6, 70, 1, 100, 101, 102, 2, 200, 3]);
    }

    #[test]
    fn a_budget_keeps_the_end_of_the_prefix_and_the_start_of_the_suffix() {
        let fim = qwen();
        let parts = InfillParts {
            prefix: (100..120).collect(),
            suffix: (200..220).collect(),
            extra: vec![ExtraChunk { header: vec![50], text: (300..340).collect() }],
            repo_line: vec![60],
            file_line: vec![70],
            ..Default::default()
        };
        let budget = InfillBudget { batch: 16, context: 40, max_tokens: 4 };
        let (prompt, truncated) = infill_prompt(&fim, &parts, Some(budget));
        assert!(truncated);
        // 16 context tokens for the extra (40 - 16 - 8), 12 of the prefix, 2 of the suffix.
        let mid = prompt.iter().position(|&t| t == 1).unwrap();
        assert_eq!(mid, 16);
        assert_eq!(&prompt[mid + 1..mid + 13], &(108..120).collect::<Vec<_>>()[..]);
        assert_eq!(&prompt[mid + 13..], [2, 200, 201, 3]);
    }

    fn run(limits: &mut LineLimits, pieces: &[&str], late: bool) -> (String, bool) {
        let mut out = String::new();
        for p in pieces {
            let step = limits.push(p, late);
            out.push_str(&step.emit);
            if step.stopped {
                return (out, true);
            }
        }
        out.push_str(&limits.finish());
        (out, false)
    }

    #[test]
    fn a_less_indented_line_ends_the_answer_without_being_sent() {
        let mut limits = LineLimits::new(4);
        let (text, stopped) =
            run(&mut limits, &["x = 1\n", "    y = 2\n", "  ", "z", " = 3\n"], false);
        assert_eq!((text.as_str(), stopped), ("x = 1\n    y = 2\n", true));
        // Indented enough: nothing stops; a blank line is indented less (as llama-server has it).
        let mut limits = LineLimits::new(4);
        let (text, stopped) = run(&mut limits, &["a\n", "    b\n", "\t\t\t\tc"], false);
        assert_eq!((text.as_str(), stopped), ("a\n    b\n\t\t\t\tc", false));
        let mut limits = LineLimits::new(4);
        assert_eq!(run(&mut limits, &["a\n", "\n", "    b"], false), ("a\n".to_string(), true));
        // The first line is the cursor's: never cut.
        let mut limits = LineLimits::new(8);
        assert_eq!(run(&mut limits, &["x"], false), ("x".to_string(), false));
    }

    #[test]
    fn past_the_time_limit_the_answer_ends_with_the_next_line_end() {
        let mut limits = LineLimits::new(0);
        let (text, stopped) = run(&mut limits, &["a = 1", "\nb = 2\n"], true);
        assert_eq!((text.as_str(), stopped), ("a = 1\n", true));
        let mut limits = LineLimits::new(0);
        assert_eq!(run(&mut limits, &["a\nb\n"], false), ("a\nb\n".to_string(), false));
    }
}
