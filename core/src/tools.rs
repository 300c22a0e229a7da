//! Tool calling: the OpenAI wire types, and the parser that finds the calls in a model's text.
//!
//! The model is told about the tools by its own chat template; it answers with calls in its own
//! format. Two are recognised:
//! - Qwen2.5 (and Hermes): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call;
//! - Llama 3.1: `<|python_tag|>` or nothing, then `{"name": ..., "parameters": {...}}`, calls separated
//!   by `;` or white space (as small Qwen models also answer); only a whole output of such objects
//!   naming the request's tools counts, so JSON that happens to be the answer stays content.
//!
//! [`ToolCallParser`] works on text as it streams: text that may be the start of a call is held back
//! until it is known, and each call is handed over once its closing marker (or the end of the
//! output) is seen. Nothing here touches a model; it is the gateway's view of the text.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// A function the model may call (`tools[i]` of a request).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolSpec {
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionSpec,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FunctionSpec {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON Schema of the arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Value>,
    /// Accepted for compatibility. Forced calls (`tool_choice` `required` or named) follow the
    /// parameters' schema whether it is set or not; other calls are parsed as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// A call the model made (`message.tool_calls[i]`), or one an earlier assistant turn made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON text, as OpenAI sends them.
    pub arguments: String,
}

/// A piece of a streamed call (`delta.tool_calls[i]`): the first carries id, type and name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCallDelta,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct FunctionCallDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

/// What the parser hands over.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolOutput {
    /// Text outside any call: the message's content.
    Text(String),
    /// A complete call: the function's name and its arguments as JSON text.
    Call { name: String, arguments: String },
}

const QWEN_OPEN: &str = "<tool_call>";
const QWEN_CLOSE: &str = "</tool_call>";
const LLAMA_TAG: &str = "<|python_tag|>";

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Ordinary text; a call may still start.
    Text,
    /// Inside `<tool_call>` … `</tool_call>`.
    Qwen,
    /// A Llama 3.1 call: everything to the end of the output is calls.
    Llama,
}

/// How a model writes its calls: what [`ToolCallParser`] reads, and what a forced call is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFormat {
    /// Qwen2.5 and Hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
    Tagged,
    /// Llama 3.1: `{"name": ..., "parameters": {...}}`.
    Bare,
}

impl CallFormat {
    /// The format a chat template teaches: tagged where it mentions `<tool_call>`.
    pub fn of_template(template: Option<&str>) -> Self {
        if template.is_some_and(|t| t.contains("<tool_call>")) {
            Self::Tagged
        } else {
            Self::Bare
        }
    }
}

/// A grammar in llguidance's Lark dialect whose sentences are one call of one of `tools` in
/// `format` (or, with `parallel`, one or more calls on lines of their own), each naming its tool and
/// with arguments valid under that tool's parameter schema (any object where it has none).
pub fn forced_calls_grammar(tools: &[ToolSpec], format: CallFormat, parallel: bool) -> String {
    let arguments_key = match format {
        CallFormat::Tagged => "arguments",
        CallFormat::Bare => "parameters",
    };
    let calls: Vec<Value> = tools
        .iter()
        .map(|t| {
            let parameters = t
                .function
                .parameters
                .clone()
                .filter(|p| p.is_object())
                .unwrap_or_else(|| serde_json::json!({"type": "object"}));
            serde_json::json!({
                "type": "object",
                "properties": {"name": {"const": t.function.name}, arguments_key: parameters},
                "required": ["name", arguments_key],
                "additionalProperties": false,
            })
        })
        .collect();
    let call_schema = serde_json::json!({"anyOf": calls});
    let call = match format {
        CallFormat::Tagged => format!("\"<tool_call>\\n\" %json {call_schema} \"\\n</tool_call>\""),
        CallFormat::Bare => format!("%json {call_schema}"),
    };
    let start = if parallel { "start: call (\"\\n\" call)*" } else { "start: call" };
    format!("{start}\ncall: {call}\n")
}

/// Splits a model's streamed text into content and tool calls.
#[derive(Debug, Clone)]
pub struct ToolCallParser {
    state: State,
    /// Text not handed over yet.
    held: String,
    /// Nothing but whitespace has been handed over: a Llama call may only start the output.
    at_start: bool,
    /// The request's tool names: bare JSON calls must name one.
    names: Vec<String>,
}

impl ToolCallParser {
    /// A parser for a request offering tools with these names.
    pub fn new(names: Vec<String>) -> Self {
        Self { state: State::Text, held: String::new(), at_start: true, names }
    }

    /// Feeds the next piece of text; returns what is now known.
    pub fn push(&mut self, text: &str) -> Vec<ToolOutput> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Text => {
                    if self.at_start {
                        let trimmed = self.held.trim_start();
                        if trimmed.starts_with(LLAMA_TAG)
                            || (trimmed.starts_with('{')
                                && trimmed.len() > 1
                                && looks_like_llama_call(trimmed))
                        {
                            self.held = trimmed.trim_start_matches(LLAMA_TAG).to_string();
                            self.state = State::Llama;
                            continue;
                        }
                        // Could still become a Llama call: wait for more.
                        if !trimmed.is_empty()
                            && (LLAMA_TAG.starts_with(trimmed)
                                || (trimmed.starts_with('{') && could_be_llama_call(trimmed)))
                        {
                            return out;
                        }
                    }
                    if let Some(at) = self.held.find(QWEN_OPEN) {
                        let before: String = self.held.drain(..at).collect();
                        self.held.drain(..QWEN_OPEN.len());
                        self.emit_text(before, &mut out);
                        self.state = State::Qwen;
                        continue;
                    }
                    // Hold back a tail that may be the start of `<tool_call>`.
                    let keep = partial_suffix(&self.held, QWEN_OPEN);
                    let ready: String = self.held.drain(..self.held.len() - keep).collect();
                    self.emit_text(ready, &mut out);
                    return out;
                }
                State::Qwen => {
                    let Some(at) = self.held.find(QWEN_CLOSE) else { return out };
                    let body: String = self.held.drain(..at).collect();
                    self.held.drain(..QWEN_CLOSE.len());
                    let call =
                        serde_json::from_str(body.trim()).ok().and_then(|v: Value| parse_call(&v));
                    match call {
                        Some(call) => out.push(call),
                        None => self.emit_text(format!("{QWEN_OPEN}{body}{QWEN_CLOSE}"), &mut out),
                    }
                    self.at_start = false;
                    self.state = State::Text;
                }
                State::Llama => return out,
            }
        }
    }

    /// The output ended: hands over what was held back (an unfinished call as text).
    pub fn finish(&mut self) -> Vec<ToolOutput> {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Text => {
                let mut out = Vec::new();
                let trimmed = held.trim_start();
                if self.at_start && trimmed.starts_with('{') {
                    if let Some(calls) = parse_llama_calls(trimmed, &self.names) {
                        return calls;
                    }
                }
                self.emit_text(held, &mut out);
                out
            }
            State::Qwen => vec![ToolOutput::Text(format!("{QWEN_OPEN}{held}"))],
            State::Llama => parse_llama_calls(&held, &self.names)
                .unwrap_or_else(|| vec![ToolOutput::Text(held)]),
        }
    }

    fn emit_text(&mut self, text: String, out: &mut Vec<ToolOutput>) {
        if text.is_empty() {
            return;
        }
        if !text.trim().is_empty() {
            self.at_start = false;
        }
        match out.last_mut() {
            Some(ToolOutput::Text(t)) => t.push_str(&text),
            _ => out.push(ToolOutput::Text(text)),
        }
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `marker`.
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// `{"name": ` so far, as a Llama call begins (the text may still be cut short).
fn could_be_llama_call(text: &str) -> bool {
    let compact: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    let head = "{\"name\":";
    compact.len() < head.len() && head.starts_with(&compact) || compact.starts_with(head)
}

fn looks_like_llama_call(text: &str) -> bool {
    let compact: String = text.chars().filter(|c| !c.is_whitespace()).take(8).collect();
    compact == "{\"name\":"
}

/// `{"name": ..., "arguments" or "parameters": {...}}` as a call.
fn parse_call(value: &Value) -> Option<ToolOutput> {
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        // Some models put the arguments in a string already.
        Some(Value::String(s)) => s.clone(),
        Some(args) => args.to_string(),
        None => "{}".to_string(),
    };
    Some(ToolOutput::Call { name, arguments })
}

/// Llama 3.1's calls: JSON objects separated by `;` or white space, each naming one of `names`.
fn parse_llama_calls(text: &str, names: &[String]) -> Option<Vec<ToolOutput>> {
    let mut calls = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let call = parse_call(&stream.next()?.ok()?)?;
        match &call {
            ToolOutput::Call { name, .. } if names.contains(name) => calls.push(call),
            _ => return None,
        }
        rest = rest[stream.byte_offset()..].trim_start();
        rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> ToolOutput {
        ToolOutput::Call { name: name.into(), arguments: arguments.into() }
    }

    fn text(t: &str) -> ToolOutput {
        ToolOutput::Text(t.into())
    }

    /// Feeds `pieces` one by one, then finishes; merges adjacent text.
    fn run(pieces: &[&str]) -> Vec<ToolOutput> {
        let mut p =
            ToolCallParser::new(vec!["f".into(), "g".into(), "t".into(), "get_weather".into()]);
        let mut out: Vec<ToolOutput> = Vec::new();
        let mut items: Vec<ToolOutput> = pieces.iter().flat_map(|piece| p.push(piece)).collect();
        items.extend(p.finish());
        for item in items {
            match (out.last_mut(), item) {
                (Some(ToolOutput::Text(a)), ToolOutput::Text(b)) => a.push_str(&b),
                (_, item) => out.push(item),
            }
        }
        out
    }

    #[test]
    fn qwen_calls_are_found_across_any_split() {
        let whole = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\", \"arguments\": {}}\n</tool_call>";
        let expected = vec![
            text("Let me check.\n"),
            call("get_weather", r#"{"city":"Paris"}"#),
            text("\n"),
            call("t", "{}"),
        ];
        assert_eq!(run(&[whole]), expected);
        for cut in 1..whole.len() {
            if whole.is_char_boundary(cut) {
                assert_eq!(run(&[&whole[..cut], &whole[cut..]]), expected, "cut at {cut}");
            }
        }
        let chars: Vec<String> = whole.chars().map(String::from).collect();
        assert_eq!(run(&chars.iter().map(String::as_str).collect::<Vec<_>>()), expected);
    }

    #[test]
    fn text_that_only_looks_like_a_call_is_text() {
        assert_eq!(run(&["a < b and <tool", "_c> x"]), vec![text("a < b and <tool_c> x")]);
        assert_eq!(
            run(&["<tool_call>not json</tool_call> done"]),
            vec![text("<tool_call>not json</tool_call> done")]
        );
        assert_eq!(
            run(&["cut off <tool_call>{\"name\": \"f\""]),
            vec![text("cut off <tool_call>{\"name\": \"f\"")]
        );
        assert_eq!(run(&["{\"a\": 1} is JSON"]), vec![text("{\"a\": 1} is JSON")]);
        // Text is not held back longer than a marker's prefix.
        let mut p =
            ToolCallParser::new(vec!["f".into(), "g".into(), "t".into(), "get_weather".into()]);
        assert_eq!(p.push("Hello <to"), vec![text("Hello ")]);
    }

    #[test]
    fn llama_calls_with_and_without_the_python_tag() {
        assert_eq!(
            run(&["<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": 1}}"]),
            vec![call("f", r#"{"x":1}"#)]
        );
        assert_eq!(
            run(&[
                "{\"name\": \"f\", ",
                "\"parameters\": {\"x\": 1}}; {\"name\": \"g\", \"parameters\": {}}"
            ]),
            vec![call("f", r#"{"x":1}"#), call("g", "{}")]
        );
        assert_eq!(run(&["  {\"na", "me\": \"f\", \"parameters\": {}}"]), vec![call("f", "{}")]);
        // One object per line, `arguments` for `parameters`: how small Qwen models answer.
        assert_eq!(
            run(&["{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n{\"name\": \"g\", \"arguments\": {}}"]),
            vec![call("f", r#"{"x":1}"#), call("g", "{}")]
        );
        // A JSON answer naming no tool of the request stays content.
        assert_eq!(
            run(&["{\"name\": \"Ada\", \"parameters\": {}}"]),
            vec![text("{\"name\": \"Ada\", \"parameters\": {}}")]
        );
    }

    #[test]
    fn wire_shapes() {
        let spec: ToolSpec = serde_json::from_value(serde_json::json!({
            "type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}, "strict": true}
        }))
        .unwrap();
        assert_eq!(spec.function.name, "get_weather");
        let delta = ToolCallDelta {
            index: 0,
            id: None,
            kind: None,
            function: FunctionCallDelta { name: None, arguments: Some("{}".into()) },
        };
        assert_eq!(
            serde_json::to_value(delta).unwrap(),
            serde_json::json!({"index": 0, "function": {"arguments": "{}"}})
        );
    }
}
