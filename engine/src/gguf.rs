//! GGUF files: locating them and reading the metadata both sides must agree on.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use sha2::{Digest, Sha256};
use spade_core::fim::{self, FimTokens};
use spade_core::grammar::{Spelling, TokenKind, Vocabulary};
use spade_core::protocol::vocabulary_mismatch;

use crate::EngineError;

/// Where a model comes from: a local `.gguf` file, or `owner/repo:file.gguf` on the Hugging Face hub.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    Local(PathBuf),
    Hub { repo: String, file: String },
}

impl ModelSource {
    /// A path that exists is local; `owner/repo:file.gguf` names a hub file; anything else is an error
    /// (a mistyped path must not silently turn into a network call).
    pub fn parse(spec: &str) -> Result<Self, EngineError> {
        let path = Path::new(spec);
        if path.is_file() {
            return Ok(Self::Local(path.to_path_buf()));
        }
        match spec.split_once(':') {
            Some((repo, file)) if repo.split('/').count() == 2 && file.ends_with(".gguf") && !spec.starts_with('/') => {
                Ok(Self::Hub { repo: repo.to_string(), file: file.to_string() })
            }
            _ => Err(EngineError::ModelNotFound(format!("{spec} (give a path to a .gguf file, or owner/repo:file.gguf for the Hugging Face hub)"))),
        }
    }

    /// A local file for this source: the path itself, or the hub file downloaded into (or found in)
    /// the Hugging Face cache. Honours `HF_HOME` (the cache), `HF_ENDPOINT` (a mirror) and `HF_TOKEN`
    /// (else the cache's token file), as Hugging Face's own tools do. Blocking; call from a blocking context.
    pub fn resolve(&self) -> Result<PathBuf, EngineError> {
        match self {
            Self::Local(p) => Ok(p.clone()),
            Self::Hub { repo, file } => {
                let mut builder = hf_hub::api::sync::ApiBuilder::from_env();
                if let Ok(token) = std::env::var("HF_TOKEN") {
                    builder = builder.with_token(Some(token));
                }
                let api = builder
                    .build()
                    .map_err(|e| EngineError::ModelNotFound(format!("{repo}:{file}: {e}")))?;
                api.model(repo.clone())
                    .get(file)
                    .map_err(|e| EngineError::ModelNotFound(format!("{repo}:{file}: {e}")))
            }
        }
    }
}

/// Facts about a model that the edge and the cloud compare.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelMeta {
    pub name: String,
    pub architecture: String,
    /// Width of the logits (rows of the output matrix).
    pub vocab_size: u32,
    /// Tokens that end a generation.
    pub stop_token_ids: Vec<u32>,
    /// sha256 of the token list without its trailing padding: equal fingerprints mean token ids
    /// mean the same text.
    pub tokenizer_fingerprint: String,
    /// Ids from here on are padding (llama.cpp's `[PAD…]` tokens, or rows past the token list):
    /// never text, so never sampled.
    pub text_tokens: u32,
    pub max_context: u32,
    pub chat_template: Option<String>,
    /// The fill-in-the-middle tokens, where the vocabulary has them.
    pub fim: Option<FimTokens>,
}

/// GGUF's token type of unused (padding) tokens.
const UNUSED_TOKEN: i32 = 5;

/// Common names of end-of-turn tokens, stopped on alongside `tokenizer.ggml.eos_token_id`.
const END_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "</s>",
    "<end_of_turn>",
];

pub(crate) struct GgufFile {
    pub path: PathBuf,
    pub content: Content,
    pub file: File,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, EngineError> {
        let mut file = File::open(path).map_err(|e| EngineError::load(path, e))?;
        let content = Content::read(&mut file).map_err(|e| EngineError::load(path, e))?;
        Ok(Self { path: path.to_path_buf(), content, file })
    }

    fn md(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    pub fn get(&self, key: &str) -> Result<&Value, EngineError> {
        self.md()
            .get(key)
            .ok_or_else(|| EngineError::load(&self.path, format!("missing metadata key {key}")))
    }

    pub fn u32(&self, key: &str) -> Result<u32, EngineError> {
        let v = self.get(key)?;
        v.to_u32()
            .or_else(|_| v.to_u64().map(|x| x as u32))
            .or_else(|_| v.to_i32().map(|x| x as u32))
            .map_err(|e| EngineError::load(&self.path, format!("{key}: {e}")))
    }

    pub fn f32(&self, key: &str) -> Result<f32, EngineError> {
        self.get(key)?.to_f32().map_err(|e| EngineError::load(&self.path, format!("{key}: {e}")))
    }

    pub fn string(&self, key: &str) -> Result<String, EngineError> {
        self.get(key)?
            .to_string()
            .cloned()
            .map_err(|e| EngineError::load(&self.path, format!("{key}: {e}")))
    }

    pub fn architecture(&self) -> Result<String, EngineError> {
        self.string("general.architecture")
    }

    /// The token list, and each token's GGUF type (empty where the file has none).
    fn tokens(&self) -> Result<(Vec<String>, Vec<i32>), EngineError> {
        let list =
            |key: &str| self.get(key)?.to_vec().map_err(|e| EngineError::load(&self.path, e));
        let tokens = list("tokenizer.ggml.tokens")?
            .iter()
            .map(|v| v.to_string().cloned().unwrap_or_default())
            .collect();
        let kinds = match self.get("tokenizer.ggml.token_type") {
            Ok(_) => {
                list("tokenizer.ggml.token_type")?.iter().map(|v| v.to_i32().unwrap_or(1)).collect()
            }
            Err(_) => Vec::new(),
        };
        Ok((tokens, kinds))
    }

    pub fn meta(&self) -> Result<ModelMeta, EngineError> {
        let arch = self.architecture()?;
        let (tokens, kinds) = self.tokens()?;
        // llama.cpp pads a token list to the output's rows with unused `[PAD<id>]` tokens; models that
        // differ only there share a tokenizer.
        let is_padding =
            |i: usize| kinds.get(i) == Some(&UNUSED_TOKEN) && tokens[i].starts_with("[PAD");
        let text_tokens = (0..tokens.len()).rev().find(|&i| !is_padding(i)).map_or(0, |i| i + 1);
        let mut hasher = Sha256::new();
        for t in &tokens[..text_tokens] {
            hasher.update(t.as_bytes());
            hasher.update([0u8]);
        }
        let fingerprint: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();

        let vocab_size = match self
            .content
            .tensor_infos
            .get("output.weight")
            .or_else(|| self.content.tensor_infos.get("token_embd.weight"))
        {
            Some(info) => info.shape.dims()[0] as u32,
            None => tokens.len() as u32,
        };
        let mut stop_token_ids: Vec<u32> =
            self.u32("tokenizer.ggml.eos_token_id").into_iter().collect();
        for (id, t) in tokens.iter().enumerate() {
            let ends = END_TOKENS.contains(&t.as_str()) || fim::END_TOKENS.contains(&t.as_str());
            if ends && !stop_token_ids.contains(&(id as u32)) {
                stop_token_ids.push(id as u32);
            }
        }
        Ok(ModelMeta {
            name: self.string("general.name").unwrap_or_else(|_| {
                self.path.file_stem().unwrap_or_default().to_string_lossy().into_owned()
            }),
            max_context: self.u32(&format!("{arch}.context_length")).unwrap_or(4096),
            architecture: arch,
            vocab_size,
            stop_token_ids,
            tokenizer_fingerprint: fingerprint,
            text_tokens: (text_tokens as u32).min(vocab_size),
            chat_template: self.string("tokenizer.chat_template").ok(),
            fim: FimTokens::find(|name| tokens.iter().position(|t| t == name).map(|i| i as u32)),
        })
    }
}

/// The model's vocabulary for constrained decoding, built from the GGUF token list (the same list
/// the fingerprint hashes). Blocking: reads the file's metadata and builds llguidance's token trie.
pub fn read_vocabulary(path: &Path, meta: &ModelMeta) -> Result<Vocabulary, EngineError> {
    let gguf = GgufFile::open(path)?;
    let (tokens, kinds) = gguf.tokens()?;
    let kinds: Vec<TokenKind> = kinds.into_iter().map(TokenKind::from_gguf).collect();
    let spelling = match gguf.string("tokenizer.ggml.model").as_deref() {
        Ok("gpt2") => Spelling::ByteLevel,
        Ok("llama" | "gemma" | "t5") => Spelling::SentencePiece,
        other => {
            return Err(EngineError::Unsupported(format!(
                "constrained decoding with tokenizer model {other:?}"
            )))
        }
    };
    Ok(Vocabulary::new(&tokens, &kinds, spelling, meta.vocab_size, &meta.stop_token_ids)?)
}

/// A model file's [`Vocabulary`], built on first use: most requests never need one.
pub(crate) struct LazyVocabulary {
    path: PathBuf,
    built: std::sync::OnceLock<Result<Vocabulary, String>>,
}

impl LazyVocabulary {
    pub fn new(path: &Path) -> Self {
        Self { path: path.to_path_buf(), built: Default::default() }
    }

    /// Blocking the first time.
    pub fn get(&self, meta: &ModelMeta) -> Result<&Vocabulary, EngineError> {
        let built =
            self.built.get_or_init(|| read_vocabulary(&self.path, meta).map_err(|e| e.to_string()));
        built.as_ref().map_err(|e| EngineError::Unsupported(e.clone()))
    }
}

/// Refuses a draft/target pair whose token ids do not mean the same text (padding rows apart).
pub fn check_same_vocabulary(draft: &ModelMeta, target: &ModelMeta) -> Result<(), EngineError> {
    match vocabulary_mismatch(
        &draft.tokenizer_fingerprint,
        draft.vocab_size,
        &target.tokenizer_fingerprint,
        target.vocab_size,
    ) {
        Some(why) => Err(EngineError::VocabMismatch(format!(
            "draft {} and target {}: {why}",
            draft.name, target.name
        ))),
        None => Ok(()),
    }
}

/// Reads the metadata of a local GGUF file.
pub fn read_meta(path: &Path) -> Result<ModelMeta, EngineError> {
    GgufFile::open(path)?.meta()
}

/// The model's facts and its token list as the GGUF spells it (`tokenizer.ggml.tokens`), without
/// reading the weights.
pub fn read_tokens(path: &Path) -> Result<(ModelMeta, Vec<String>), EngineError> {
    let gguf = GgufFile::open(path)?;
    Ok((gguf.meta()?, gguf.tokens()?.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_paths_and_hub_ids() {
        let here = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        assert_eq!(ModelSource::parse(here).unwrap(), ModelSource::Local(PathBuf::from(here)));
        assert_eq!(
            ModelSource::parse(
                "bartowski/Llama-3.2-1B-Instruct-GGUF:Llama-3.2-1B-Instruct-Q4_K_M.gguf"
            )
            .unwrap(),
            ModelSource::Hub {
                repo: "bartowski/Llama-3.2-1B-Instruct-GGUF".into(),
                file: "Llama-3.2-1B-Instruct-Q4_K_M.gguf".into()
            }
        );
        // A mistyped path must not turn into a network call.
        for bad in [
            "models/missing.gguf",
            "/abs/missing.gguf",
            "owner/repo",
            "owner/repo:weights.bin",
            "a/b/c:x.gguf",
        ] {
            assert!(matches!(ModelSource::parse(bad), Err(EngineError::ModelNotFound(_))), "{bad}");
        }
    }
}
