//! Constrained decoding (structured outputs, forced tool calls): a grammar in llguidance's format
//! masks a model's logits position by position, exactly as target-only decoding would.
//!
//! The verifier masks p with the state reached over the context and the block's earlier drafts (a
//! draft outside the grammar has p = 0 and is rejected); the draft masks q the same way, which only
//! raises acceptance. Both sides build their [`Vocabulary`] from their own GGUF token list, which
//! the fingerprint check has already proven identical.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use utoipa::ToSchema;

/// A grammar on the wire: llguidance's grammar document and the position of its first token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GrammarConstraint {
    /// llguidance's `TopLevelGrammar`, e.g. `{"grammars": [{"json_schema": {...}}]}` or
    /// `{"grammars": [{"lark_grammar": "start: ..."}]}`.
    #[schema(value_type = Object)]
    pub grammar: serde_json::Value,
    /// Position of the first constrained token (the prompt's length): the grammar matches
    /// `context[start..]` followed by the drafts.
    pub start: u32,
}

impl GrammarConstraint {
    /// Output that is one JSON value valid under `schema`.
    pub fn json_schema(schema: serde_json::Value, start: u32) -> Self {
        Self::from_top_level(TopLevelGrammar::from_json_schema(schema), start)
    }

    /// Output in llguidance's Lark dialect (`%json {...}` embeds a JSON schema).
    pub fn lark(grammar: String, start: u32) -> Self {
        Self::from_top_level(TopLevelGrammar::from_lark(grammar), start)
    }

    fn from_top_level(grammar: TopLevelGrammar, start: u32) -> Self {
        Self {
            grammar: serde_json::to_value(grammar).expect("llguidance grammars serialise"),
            start,
        }
    }
}

/// OpenAI's `response_format` as an llguidance grammar document: None for plain text (`null` or
/// `{"type": "text"}`); `json_object` is any JSON object; `json_schema` is its `schema` (any JSON
/// value when it has none), enforced whether `strict` is set or not. Errors are `(param, message)`.
pub fn response_format_grammar(
    format: &serde_json::Value,
) -> Result<Option<serde_json::Value>, (String, String)> {
    let err = |param: &str, message: &str| Err((param.to_string(), message.to_string()));
    if format.is_null() {
        return Ok(None);
    }
    let schema = match format.get("type").and_then(|t| t.as_str()) {
        Some("text") => return Ok(None),
        Some("json_object") => serde_json::json!({"type": "object"}),
        Some("json_schema") => {
            let Some(spec) = format.get("json_schema").filter(|s| s.is_object()) else {
                return err("response_format.json_schema", "response_format of type json_schema needs a json_schema object with a name and a schema");
            };
            if spec.get("name").and_then(|n| n.as_str()).is_none_or(str::is_empty) {
                return err(
                    "response_format.json_schema.name",
                    "json_schema.name must be a non-empty string",
                );
            }
            match spec.get("schema") {
                None | Some(serde_json::Value::Null) => serde_json::json!({}),
                Some(s) if s.is_object() || s.is_boolean() => s.clone(),
                Some(_) => {
                    return err(
                        "response_format.json_schema.schema",
                        "json_schema.schema must be a JSON Schema object",
                    )
                }
            }
        }
        _ => {
            return err(
                "response_format.type",
                "response_format.type must be \"text\", \"json_object\" or \"json_schema\"",
            )
        }
    };
    Ok(Some(GrammarConstraint::json_schema(schema, 0).grammar))
}

#[derive(Debug, Clone, PartialEq, Error)]
pub enum GrammarError {
    #[error("invalid grammar: {0}")]
    Invalid(String),
    #[error("token {token} at output position {position} is not allowed by the grammar")]
    Violated { token: u32, position: usize },
    #[error("grammar engine: {0}")]
    Engine(String),
}

/// How a GGUF vocabulary spells its tokens (`tokenizer.ggml.model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spelling {
    /// GPT-2 byte-level BPE ("gpt2": Qwen, Llama 3, SmolLM): every byte is one printable character.
    ByteLevel,
    /// SentencePiece ("llama", "gemma"): `▁` is a space, `<0xNN>` tokens are raw bytes.
    SentencePiece,
}

/// What a token is (`tokenizer.ggml.token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    Normal,
    /// Control, unknown and padding tokens: never text; end-of-sequence ones are allowed where the
    /// grammar may end.
    Special,
    /// A SentencePiece byte token, `<0xNN>`.
    Byte,
}

impl TokenKind {
    /// From GGUF's token type numbers (llama.cpp's `llama_token_type`): unknown, control and unused
    /// (padding) tokens are never text.
    pub fn from_gguf(kind: i32) -> Self {
        match kind {
            2 | 3 | 5 => Self::Special,
            6 => Self::Byte,
            _ => Self::Normal,
        }
    }
}

/// A model's vocabulary as the grammar engine sees it: each token id's bytes.
#[derive(Clone)]
pub struct Vocabulary {
    factory: Arc<ParserFactory>,
}

impl Vocabulary {
    /// `tokens[i]` is token i as the GGUF spells it; `width` is the logits' width (padding ids past
    /// the token list are never allowed); `stop` the ids that end a generation, all allowed once the
    /// grammar is complete.
    pub fn new(
        tokens: &[String],
        kinds: &[TokenKind],
        spelling: Spelling,
        width: u32,
        stop: &[u32],
    ) -> Result<Self, GrammarError> {
        if tokens.len() > width as usize || stop.is_empty() || stop.iter().any(|&s| s >= width) {
            return Err(GrammarError::Engine(format!(
                "{} tokens, logits of width {width}, stop ids {stop:?}",
                tokens.len()
            )));
        }
        let unicode_to_byte = byte_level_alphabet();
        let mut words: Vec<Vec<u8>> = tokens
            .iter()
            .enumerate()
            .map(|(i, text)| match (kinds.get(i).copied().unwrap_or(TokenKind::Normal), spelling) {
                (TokenKind::Special, _) => {
                    [&[TokTrie::SPECIAL_TOKEN_MARKER], text.as_bytes()].concat()
                }
                (TokenKind::Byte, _) => sentencepiece_byte(text)
                    .map(|b| vec![b])
                    .unwrap_or_else(|| text.as_bytes().to_vec()),
                (TokenKind::Normal, Spelling::SentencePiece) => {
                    text.replace('\u{2581}', " ").into_bytes()
                }
                (TokenKind::Normal, Spelling::ByteLevel) => {
                    let mut bytes = Vec::with_capacity(text.len());
                    for c in text.chars() {
                        match unicode_to_byte.get(c as usize) {
                            Some(&Some(b)) => bytes.push(b),
                            // Added tokens may be stored as plain text.
                            _ => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                        }
                    }
                    bytes
                }
            })
            .collect();
        words.resize(width as usize, Vec::new());
        let trie = TokTrie::from(&TokRxInfo::new(width, stop[0]), &words).with_eos_tokens(stop);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Engine(e.to_string()))?;
        factory.quiet();
        Ok(Self { factory: Arc::new(factory) })
    }

    /// Compiles a grammar document; errors name what is wrong with it.
    pub fn compile(&self, grammar: &serde_json::Value) -> Result<Grammar, GrammarError> {
        let top: TopLevelGrammar = serde_json::from_value(grammar.clone())
            .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let parser =
            self.factory.create_parser(top).map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(GrammarError::Invalid(e)),
            None => Ok(Grammar { fresh: matcher }),
        }
    }
}

/// GPT-2's byte-to-unicode alphabet, inverted: printable bytes stand for themselves, the others
/// (controls, space, DEL, NBSP, soft hyphen) for 256 + their index among them.
fn byte_level_alphabet() -> Vec<Option<u8>> {
    let mut table = vec![None; 512];
    let mut next = 256;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable {
            table[b as usize] = Some(b);
        } else {
            table[next] = Some(b);
            next += 1;
        }
    }
    table
}

fn sentencepiece_byte(text: &str) -> Option<u8> {
    u8::from_str_radix(text.strip_prefix("<0x")?.strip_suffix('>')?, 16).ok()
}

/// A compiled grammar, not yet advanced: cloning it starts a generation cheaply.
#[derive(Clone)]
pub struct Grammar {
    fresh: Matcher,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammar")
    }
}

impl Grammar {
    /// The grammar's state before the output position `start` of a generation.
    pub fn start_at(&self, start: usize) -> GrammarState {
        GrammarState { matcher: self.fresh.clone(), start, consumed: Vec::new() }
    }
}

/// One generation's grammar state: what the output so far allows next.
pub struct GrammarState {
    matcher: Matcher,
    start: usize,
    /// The tokens the matcher has consumed, from position `start` on.
    consumed: Vec<u32>,
}

impl GrammarState {
    /// Brings the state to the end of `context`, whose tokens from `start` on are the output so far:
    /// rolls back whatever the state holds beyond their common prefix and consumes the rest.
    pub fn sync(&mut self, context: &[u32]) -> Result<(), GrammarError> {
        let output = context.get(self.start..).unwrap_or_default();
        let common = self.consumed.iter().zip(output).take_while(|(a, b)| a == b).count();
        self.pop(self.consumed.len() - common)?;
        for &token in &output[common..] {
            if !self.push(token)? {
                return Err(GrammarError::Violated { token, position: self.consumed.len() });
            }
        }
        Ok(())
    }

    /// The tokens allowed next; only stop tokens once the grammar is complete.
    pub fn allowed(&mut self) -> Result<SimpleVob, GrammarError> {
        self.matcher.compute_mask_or_eos().map_err(|e| GrammarError::Engine(e.to_string()))
    }

    /// Sets the logits of tokens the grammar does not allow next to minus infinity; an error, with
    /// the logits untouched, if it allows none of them.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let allowed = self.allowed()?;
        if !(0..logits.len()).any(|t| allowed.is_allowed(t as u32)) {
            return Err(GrammarError::Engine("the grammar allows no token here".into()));
        }
        mask_with(&allowed, logits);
        Ok(())
    }

    /// Advances over `token` if the grammar allows it (false, and nothing changes, if not).
    pub fn push(&mut self, token: u32) -> Result<bool, GrammarError> {
        if self.matcher.is_stopped() {
            return Ok(false);
        }
        let taken = self
            .matcher
            .try_consume_tokens(&[token])
            .map_err(|e| GrammarError::Engine(e.to_string()))?;
        if taken == 1 {
            self.consumed.push(token);
        }
        Ok(taken == 1)
    }

    /// Takes back the last `n` pushed tokens.
    pub fn pop(&mut self, n: usize) -> Result<(), GrammarError> {
        if n > 0 {
            self.matcher.rollback(n).map_err(|e| GrammarError::Engine(e.to_string()))?;
            self.consumed.truncate(self.consumed.len() - n);
        }
        Ok(())
    }

    /// Masks a block's rows: row i with the state after the block's drafts `..i`. Rows after a draft
    /// the grammar refuses get that draft's row mask (the rule never looks past a refused draft, whose
    /// p is 0). The state is left where it was.
    pub fn mask_block(
        &mut self,
        rows: &mut [Vec<f32>],
        drafts: &[u32],
    ) -> Result<(), GrammarError> {
        let mut pushed = 0;
        let mut allowed = self.allowed()?;
        let last = rows.len().saturating_sub(1);
        for (i, row) in rows.iter_mut().enumerate() {
            mask_with(&allowed, row);
            if i < last && pushed == i {
                if let Some(&draft) = drafts.get(i) {
                    if self.push(draft)? {
                        pushed += 1;
                        allowed = self.allowed()?;
                    }
                }
            }
        }
        self.pop(pushed)
    }
}

fn mask_with(allowed: &SimpleVob, logits: &mut [f32]) {
    for (token, logit) in logits.iter_mut().enumerate() {
        if !allowed.is_allowed(token as u32) {
            *logit = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Single characters, a few words, two stop tokens: enough to spell JSON several ways.
    fn vocabulary() -> (Vocabulary, Vec<String>) {
        let mut tokens: Vec<String> = (b' '..=b'~').map(|b| (b as char).to_string()).collect();
        tokens
            .extend(["\n", "{\"", "\":", "true", "false", "<|end|>", "<|stop|>"].map(String::from));
        let mut kinds = vec![TokenKind::Normal; tokens.len()];
        let n = tokens.len();
        kinds[n - 2] = TokenKind::Special;
        kinds[n - 1] = TokenKind::Special;
        // Byte-level spelling: a space is 'Ġ' (U+0120), a newline 'Ċ' (U+010A).
        let spelt: Vec<String> =
            tokens.iter().map(|t| t.replace(' ', "\u{120}").replace('\n', "\u{10A}")).collect();
        let vocab = Vocabulary::new(
            &spelt,
            &kinds,
            Spelling::ByteLevel,
            n as u32 + 3,
            &[n as u32 - 2, n as u32 - 1],
        )
        .unwrap();
        (vocab, tokens)
    }

    fn id(tokens: &[String], text: &str) -> u32 {
        tokens.iter().position(|t| t == text).unwrap() as u32
    }

    fn allowed_texts(state: &mut GrammarState, tokens: &[String]) -> Vec<String> {
        let allowed = state.allowed().unwrap();
        tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| allowed.is_allowed(*i as u32))
            .map(|(_, t)| t.clone())
            .collect()
    }

    fn flag_schema() -> Grammar {
        let (vocab, _) = vocabulary();
        let schema = serde_json::json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false});
        vocab.compile(&GrammarConstraint::json_schema(schema, 0).grammar).unwrap()
    }

    #[test]
    fn a_schema_allows_exactly_its_json_and_stop_tokens_only_at_the_end() {
        let (_, tokens) = vocabulary();
        let mut state = flag_schema().start_at(2);
        let t = |s| id(&tokens, s);
        // The prompt (positions 0 and 1) is not constrained.
        state.sync(&[t("x"), t("y")]).unwrap();
        let first = allowed_texts(&mut state, &tokens);
        assert!(
            first.contains(&"{".to_string()) && first.contains(&"{\"".to_string()),
            "{first:?}"
        );
        assert!(!first.contains(&"<|end|>".to_string()) && !first.contains(&"x".to_string()));
        let output = ["{\"", "o", "k", "\":", "true", "}"].map(t);
        let context: Vec<u32> = [t("x"), t("y")].into_iter().chain(output).collect();
        state.sync(&context).unwrap();
        assert_eq!(allowed_texts(&mut state, &tokens), ["<|end|>", "<|stop|>"]);
        // Padding ids past the token list are never allowed.
        assert!(!state.allowed().unwrap().is_allowed(tokens.len() as u32 + 1));
    }

    #[test]
    fn sync_rolls_back_to_the_common_prefix_and_refuses_text_outside_the_grammar() {
        let (_, tokens) = vocabulary();
        let t = |s| id(&tokens, s);
        let mut state = flag_schema().start_at(0);
        state.sync(&["{\"", "o", "k", "\":", "true"].map(t)).unwrap();
        state.sync(&["{\"", "o", "k", "\":", "f"].map(t)).unwrap();
        assert!(allowed_texts(&mut state, &tokens).contains(&"a".to_string()));
        assert_eq!(
            state.sync(&["{\"", "x"].map(t)),
            Err(GrammarError::Violated { token: t("x"), position: 1 })
        );
    }

    #[test]
    fn a_block_is_masked_row_by_row_and_the_state_is_left_unchanged() {
        let (_, tokens) = vocabulary();
        let t = |s| id(&tokens, s);
        let width = tokens.len() + 3;
        let mut state = flag_schema().start_at(0);
        state.sync(&["{\"", "o", "k", "\":"].map(t)).unwrap();
        // Drafts "true" then "x" (refused): row 0 before "true", row 1 after it, row 2 as row 1.
        let mut rows = vec![vec![0.0f32; width]; 3];
        state.mask_block(&mut rows, &[t("true"), t("x")]).unwrap();
        let open = |row: &Vec<f32>| {
            tokens
                .iter()
                .enumerate()
                .filter(|(i, _)| row[*i].is_finite())
                .map(|(_, s)| s.clone())
                .collect::<Vec<_>>()
        };
        assert!(
            open(&rows[0]).contains(&"true".to_string())
                && open(&rows[0]).contains(&"f".to_string())
        );
        assert!(
            open(&rows[1]).contains(&"}".to_string())
                && !open(&rows[1]).contains(&"true".to_string())
        );
        assert_eq!(open(&rows[1]), open(&rows[2]));
        assert_eq!(state.consumed, ["{\"", "o", "k", "\":"].map(t));
        // A refused first draft masks every row like the first.
        let mut rows = vec![vec![0.0f32; width]; 2];
        state.mask_block(&mut rows, &[t("x")]).unwrap();
        assert_eq!(open(&rows[0]), open(&rows[1]));
    }

    #[test]
    fn bad_grammars_are_named() {
        let (vocab, _) = vocabulary();
        let bad = GrammarConstraint::json_schema(serde_json::json!({"type": "no-such-type"}), 0);
        assert!(matches!(vocab.compile(&bad.grammar), Err(GrammarError::Invalid(_))));
        assert!(matches!(
            vocab.compile(&serde_json::json!({"grammars": 3})),
            Err(GrammarError::Invalid(_))
        ));
        let lark = GrammarConstraint::lark("start: \"yes\" | \"no\"".into(), 0);
        assert!(vocab.compile(&lark.grammar).is_ok());
    }

    #[test]
    fn response_formats_become_grammars_or_named_errors() {
        use serde_json::json;
        assert_eq!(response_format_grammar(&json!(null)), Ok(None));
        assert_eq!(response_format_grammar(&json!({"type": "text"})), Ok(None));
        let object = response_format_grammar(&json!({"type": "json_object"})).unwrap().unwrap();
        assert_eq!(object, GrammarConstraint::json_schema(json!({"type": "object"}), 0).grammar);
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let named = json!({"type": "json_schema", "json_schema": {"name": "thing", "strict": true, "schema": schema}});
        assert_eq!(
            response_format_grammar(&named).unwrap().unwrap(),
            GrammarConstraint::json_schema(schema, 0).grammar
        );
        for (bad, param) in [
            (json!({"type": "yaml"}), "response_format.type"),
            (json!({}), "response_format.type"),
            (json!({"type": "json_schema"}), "response_format.json_schema"),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {}}}),
                "response_format.json_schema.name",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}),
                "response_format.json_schema.schema",
            ),
        ] {
            assert_eq!(response_format_grammar(&bad).unwrap_err().0, param, "{bad}");
        }
    }

    /// Whether `text`, spelt one character per token, is a complete sentence of `grammar`.
    fn accepts(grammar: &Grammar, tokens: &[String], text: &str) -> bool {
        let ids: Vec<u32> = text.chars().map(|c| id(tokens, &c.to_string())).collect();
        let mut state = grammar.start_at(0);
        state.sync(&ids).is_ok() && state.allowed().unwrap().is_allowed(id(tokens, "<|end|>"))
    }

    #[test]
    fn forced_tool_calls_name_a_tool_and_follow_its_parameters() {
        use crate::tools::{forced_calls_grammar, CallFormat, FunctionSpec, ToolSpec};
        let (vocab, tokens) = vocabulary();
        let tool = |name: &str, parameters| ToolSpec {
            kind: "function".into(),
            function: FunctionSpec {
                name: name.into(),
                description: None,
                parameters: Some(parameters),
                strict: None,
            },
        };
        let tools = [
            tool(
                "add",
                serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
            ),
            tool("now", serde_json::json!({"type": "object", "properties": {}})),
        ];
        let compile = |format, parallel| {
            vocab
                .compile(
                    &GrammarConstraint::lark(forced_calls_grammar(&tools, format, parallel), 0)
                        .grammar,
                )
                .unwrap()
        };
        let tagged = compile(CallFormat::Tagged, false);
        assert!(accepts(
            &tagged,
            &tokens,
            "<tool_call>\n{\"name\":\"add\",\"arguments\":{\"a\":2}}\n</tool_call>"
        ));
        assert!(!accepts(
            &tagged,
            &tokens,
            "<tool_call>\n{\"name\":\"add\",\"arguments\":{\"a\":\"2\"}}\n</tool_call>"
        ));
        assert!(!accepts(
            &tagged,
            &tokens,
            "<tool_call>\n{\"name\":\"sub\",\"arguments\":{}}\n</tool_call>"
        ));
        let one = "<tool_call>\n{\"name\":\"now\",\"arguments\":{}}\n</tool_call>";
        assert!(!accepts(&tagged, &tokens, &format!("{one}\n{one}")));
        assert!(accepts(&compile(CallFormat::Tagged, true), &tokens, &format!("{one}\n{one}")));
        let bare = compile(CallFormat::Bare, false);
        assert!(accepts(&bare, &tokens, "{\"name\":\"now\",\"parameters\":{}}"));
        assert!(!accepts(&bare, &tokens, "Sure: {\"name\":\"now\",\"parameters\":{}}"));
    }

    #[test]
    fn the_byte_level_alphabet_covers_every_byte_once() {
        let table = byte_level_alphabet();
        let mut seen: Vec<u8> = table.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..=255).collect::<Vec<u8>>());
        assert_eq!(table['\u{120}' as usize], Some(b' '));
        assert_eq!(table['\u{10A}' as usize], Some(b'\n'));
    }
}
