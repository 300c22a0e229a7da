//! A decoder-only transformer (llama and qwen2 GGUF layouts) with a truncatable KV cache and logits at
//! every scored position.
//!
//! Every operation is row-independent with a fixed reduction order (multi-row matmuls from
//! [`QWeight`], per-row norms, per-(row, head) attention sums), so a position's logits are bit-identical
//! whether it is scored alone or in a block. That is what makes greedy speculative output identical
//! token for token to the target's own greedy output.

use candle_core::quantized::gguf_file::Content;
use candle_core::Device;
use spade_core::fastmath;

use super::attention::{attention, HeadShape};
use super::qweight::QWeight;
use crate::gguf::GgufFile;
use crate::EngineError;

/// Positions processed per forward chunk during long prefills (bounds activation memory).
const CHUNK: usize = 256;

/// Spare KV positions kept per layer, so a verify round's few appended rows rarely reallocate.
const HEADROOM: usize = 64;

/// Runs a forward pass on a rayon worker. From any other thread each parallel op of the pass (every
/// matmul, attention) would be handed to the pool and waited for, a pair of context switches each;
/// on a worker they run in place and the pass is handed over once. Where an op runs does not change
/// its arithmetic.
fn in_pool<R: Send>(pass: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| pass())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RopeStyle {
    /// llama GGUF (llama.cpp permutes q/k so adjacent pairs rotate together).
    Interleaved,
    /// qwen2: the first and second halves of each head rotate together.
    Neox,
}

#[derive(Debug, Clone)]
struct Config {
    n_layers: usize,
    hidden: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    rope_dim: usize,
    rope_style: RopeStyle,
    /// Per rotary pair: theta_i, already divided by any Llama-3 frequency factor.
    inv_freq: Vec<f64>,
    eps: f32,
}

struct Layer {
    attn_norm: Vec<f32>,
    wq: QWeight,
    wk: QWeight,
    wv: QWeight,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    wo: QWeight,
    ffn_norm: Vec<f32>,
    w_gate: QWeight,
    w_up: QWeight,
    w_down: QWeight,
}

pub struct Transformer {
    cfg: Config,
    embed: QWeight,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    /// None when the output matrix is tied to the embeddings.
    lm_head: Option<QWeight>,
}

/// Keys and values of the positions scored so far, layout `[position][kv_head][head_dim]` per layer.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Drops positions from `len` on and trims spare capacity to [`HEADROOM`] positions, so the bytes a
    /// session reports are the bytes it holds.
    pub fn truncate(&mut self, len: usize, row: usize) {
        let len = len.min(self.len);
        for k in self.keys.iter_mut().chain(self.values.iter_mut()) {
            k.truncate(len * row);
            k.shrink_to((len + HEADROOM) * row);
        }
        self.len = len;
    }

    pub fn bytes(&self) -> usize {
        self.keys.iter().chain(self.values.iter()).map(|v| v.capacity() * 4).sum()
    }

    /// A new cache holding this one's first `len` positions, with [`HEADROOM`] spare ones.
    fn copy_prefix(&self, len: usize, row: usize) -> Self {
        let len = len.min(self.len);
        let copy = |v: &Vec<f32>| {
            let mut out = Vec::with_capacity((len + HEADROOM) * row);
            out.extend_from_slice(&v[..len * row]);
            out
        };
        Self {
            keys: self.keys.iter().map(copy).collect(),
            values: self.values.iter().map(copy).collect(),
            len,
        }
    }
}

struct Loader<'a> {
    gguf: &'a mut GgufFile,
}

impl Loader<'_> {
    fn content(&self) -> &Content {
        &self.gguf.content
    }

    fn has(&self, name: &str) -> bool {
        self.content().tensor_infos.contains_key(name)
    }

    fn qweight(&mut self, name: &str) -> Result<QWeight, EngineError> {
        let g = &mut *self.gguf;
        let t = g
            .content
            .tensor(&mut g.file, name, &Device::Cpu)
            .map_err(|e| EngineError::load(&g.path, e))?;
        QWeight::from_qtensor(&t)
    }

    fn vector(&mut self, name: &str) -> Result<Vec<f32>, EngineError> {
        let g = &mut *self.gguf;
        let t = g
            .content
            .tensor(&mut g.file, name, &Device::Cpu)
            .map_err(|e| EngineError::load(&g.path, e))?;
        Ok(t.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?)
    }

    fn optional_vector(&mut self, name: &str) -> Result<Option<Vec<f32>>, EngineError> {
        if self.has(name) {
            self.vector(name).map(Some)
        } else {
            Ok(None)
        }
    }
}

impl Transformer {
    pub(crate) fn load(gguf: &mut GgufFile) -> Result<Self, EngineError> {
        let arch = gguf.architecture()?;
        let rope_style = match arch.as_str() {
            "llama" | "mistral" => RopeStyle::Interleaved,
            "qwen2" => RopeStyle::Neox,
            other => {
                return Err(EngineError::Unsupported(format!(
                    "architecture {other} (the scorer supports llama and qwen2)"
                )))
            }
        };
        let key = |k: &str| format!("{arch}.{k}");
        let hidden = gguf.u32(&key("embedding_length"))? as usize;
        let n_heads = gguf.u32(&key("attention.head_count"))? as usize;
        let n_kv_heads =
            gguf.u32(&key("attention.head_count_kv")).map(|x| x as usize).unwrap_or(n_heads);
        let head_dim =
            gguf.u32(&key("attention.key_length")).map(|x| x as usize).unwrap_or(hidden / n_heads);
        let rope_dim =
            gguf.u32(&key("rope.dimension_count")).map(|x| x as usize).unwrap_or(head_dim);
        let theta = gguf.f32(&key("rope.freq_base")).unwrap_or(10_000.0) as f64;
        let n_layers = gguf.u32(&key("block_count"))? as usize;
        let eps = gguf.f32(&key("attention.layer_norm_rms_epsilon"))?;
        if !n_heads.is_multiple_of(n_kv_heads) || rope_dim > head_dim || !rope_dim.is_multiple_of(2)
        {
            return Err(EngineError::Unsupported(format!(
                "head layout {n_heads}/{n_kv_heads}/{head_dim}/{rope_dim}"
            )));
        }

        let mut ld = Loader { gguf };
        // Llama 3.1 rope scaling is stored by llama.cpp as per-pair frequency divisors.
        let factors = ld.optional_vector("rope_freqs.weight")?;
        let inv_freq = (0..rope_dim / 2)
            .map(|i| {
                theta.powf(-((2 * i) as f64) / rope_dim as f64)
                    / factors.as_ref().map_or(1.0, |f| f[i] as f64)
            })
            .collect();
        let cfg = Config {
            n_layers,
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dim,
            rope_style,
            inv_freq,
            eps,
        };

        let mut layers = Vec::with_capacity(n_layers);
        for i in 0..n_layers {
            let b = |n: &str| format!("blk.{i}.{n}");
            layers.push(Layer {
                attn_norm: ld.vector(&b("attn_norm.weight"))?,
                wq: ld.qweight(&b("attn_q.weight"))?,
                wk: ld.qweight(&b("attn_k.weight"))?,
                wv: ld.qweight(&b("attn_v.weight"))?,
                bq: ld.optional_vector(&b("attn_q.bias"))?,
                bk: ld.optional_vector(&b("attn_k.bias"))?,
                bv: ld.optional_vector(&b("attn_v.bias"))?,
                wo: ld.qweight(&b("attn_output.weight"))?,
                ffn_norm: ld.vector(&b("ffn_norm.weight"))?,
                w_gate: ld.qweight(&b("ffn_gate.weight"))?,
                w_up: ld.qweight(&b("ffn_up.weight"))?,
                w_down: ld.qweight(&b("ffn_down.weight"))?,
            });
        }
        let embed = ld.qweight("token_embd.weight")?;
        let lm_head =
            if ld.has("output.weight") { Some(ld.qweight("output.weight")?) } else { None };
        let out_norm = ld.vector("output_norm.weight")?;
        let model = Self { cfg, embed, layers, out_norm, lm_head };
        if model.layers[0].wq.out_features() != n_heads * head_dim
            || model.embed.in_features() != hidden
        {
            return Err(EngineError::Unsupported(
                "tensor shapes disagree with the metadata".into(),
            ));
        }
        Ok(model)
    }

    pub fn vocab_size(&self) -> usize {
        self.lm_head.as_ref().unwrap_or(&self.embed).out_features()
    }

    /// KV bytes per cached position.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.cfg.n_layers * 2 * self.cfg.n_kv_heads * self.cfg.head_dim * 4
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache {
            keys: vec![Vec::new(); self.cfg.n_layers],
            values: vec![Vec::new(); self.cfg.n_layers],
            len: 0,
        }
    }

    fn kv_row(&self) -> usize {
        self.cfg.n_kv_heads * self.cfg.head_dim
    }

    pub fn truncate(&self, cache: &mut KvCache, len: usize) {
        cache.truncate(len, self.kv_row());
    }

    /// A copy of `cache`'s first `len` positions: the rows a cold prefill of them computes, since
    /// every row is computed the same whatever the chunking (module doc).
    pub fn copy_prefix(&self, cache: &KvCache, len: usize) -> KvCache {
        cache.copy_prefix(len, self.kv_row())
    }

    /// Appends `tokens` at positions `cache.len()..` and returns the logits of the last `logit_rows`
    /// of them, `[logit_rows][vocab]`.
    pub fn forward(&self, cache: &mut KvCache, tokens: &[u32], logit_rows: usize) -> Vec<Vec<f32>> {
        in_pool(|| self.forward_here(cache, tokens, logit_rows))
    }

    fn forward_here(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        logit_rows: usize,
    ) -> Vec<Vec<f32>> {
        let first_kept = tokens.len() - logit_rows;
        let mut finals: Vec<f32> = Vec::with_capacity(logit_rows * self.cfg.hidden);
        for (c, chunk) in tokens.chunks(CHUNK).enumerate() {
            let hidden = self.forward_rows(&mut [Part { cache: &mut *cache, tokens: chunk }]);
            let skip = first_kept.saturating_sub(c * CHUNK).min(chunk.len());
            finals.extend_from_slice(&hidden[skip * self.cfg.hidden..]);
        }
        self.logits(&finals)
    }

    /// One forward pass over several caches at once: part i appends `tokens` to its cache and gets
    /// the logits of its last `logit_rows[i]` rows. The linear layers run over every part's rows
    /// together (the weights are read once per pass, each block unpacked once per tile of rows),
    /// attention runs per part. Every operation is row-independent, so each part's logits are
    /// bit-identical to [`Self::forward`] on that part alone. The caller bounds the rows (the
    /// verifier's `--max-batch-rows`): unlike `forward`, this does not split them into chunks.
    pub fn forward_batch(
        &self,
        parts: &mut [Part<'_>],
        logit_rows: &[usize],
    ) -> Vec<Vec<Vec<f32>>> {
        in_pool(|| self.forward_batch_here(parts, logit_rows))
    }

    fn forward_batch_here(
        &self,
        parts: &mut [Part<'_>],
        logit_rows: &[usize],
    ) -> Vec<Vec<Vec<f32>>> {
        let d = self.cfg.hidden;
        let hidden = self.forward_rows(parts);
        let mut finals: Vec<f32> = Vec::with_capacity(logit_rows.iter().sum::<usize>() * d);
        let mut row0 = 0;
        for (part, &n) in parts.iter().zip(logit_rows) {
            let end = row0 + part.tokens.len();
            finals.extend_from_slice(&hidden[(end - n) * d..end * d]);
            row0 = end;
        }
        let mut logits = self.logits(&finals).into_iter();
        logit_rows.iter().map(|&n| logits.by_ref().take(n).collect()).collect()
    }

    /// Final norm and output head over `[rows][hidden]`.
    fn logits(&self, finals: &[f32]) -> Vec<Vec<f32>> {
        if finals.is_empty() {
            return Vec::new();
        }
        let normed = rms_norm_rows(finals, &self.out_norm, self.cfg.eps);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let logits = head.forward(&normed, finals.len() / self.cfg.hidden);
        logits.chunks(head.out_features()).map(<[f32]>::to_vec).collect()
    }

    /// The hidden states `[rows][hidden]` of every part's new rows, in order, after the last layer.
    fn forward_rows(&self, parts: &mut [Part<'_>]) -> Vec<f32> {
        let cfg = &self.cfg;
        let m: usize = parts.iter().map(|p| p.tokens.len()).sum();
        let mut x: Vec<f32> =
            parts.iter().flat_map(|p| p.tokens).flat_map(|&t| self.embed.row(t as usize)).collect();
        let ropes: Vec<RopeTable> =
            parts.iter().map(|p| RopeTable::new(cfg, p.cache.len, p.tokens.len())).collect();
        let (q_row, kv_row) = (cfg.n_heads * cfg.head_dim, self.kv_row());
        let heads =
            HeadShape { n_heads: cfg.n_heads, n_kv_heads: cfg.n_kv_heads, head_dim: cfg.head_dim };
        for (l, layer) in self.layers.iter().enumerate() {
            let h = rms_norm_rows(&x, &layer.attn_norm, cfg.eps);
            let mut q = layer.wq.forward(&h, m);
            let mut k = layer.wk.forward(&h, m);
            let mut v = layer.wv.forward(&h, m);
            add_bias(&mut q, layer.bq.as_deref());
            add_bias(&mut k, layer.bk.as_deref());
            add_bias(&mut v, layer.bv.as_deref());
            let mut attn = Vec::with_capacity(m * q_row);
            let mut row0 = 0;
            for (part, rope) in parts.iter_mut().zip(&ropes) {
                let rows = part.tokens.len();
                let (q, k, v) = (
                    &mut q[row0 * q_row..(row0 + rows) * q_row],
                    &mut k[row0 * kv_row..(row0 + rows) * kv_row],
                    &v[row0 * kv_row..(row0 + rows) * kv_row],
                );
                rope.apply(q, cfg.n_heads, cfg);
                rope.apply(k, cfg.n_kv_heads, cfg);
                let cache = &mut *part.cache;
                for (buf, rows) in [(&mut cache.keys[l], &*k), (&mut cache.values[l], v)] {
                    // Grow by what is needed plus headroom, not by doubling: capacity is memory the
                    // session budget counts.
                    if buf.capacity() - buf.len() < rows.len() {
                        buf.reserve_exact(rows.len() + HEADROOM * kv_row);
                    }
                    buf.extend_from_slice(rows);
                }
                attn.extend(attention(heads, q, &cache.keys[l], &cache.values[l], cache.len, rows));
                row0 += rows;
            }
            let o = layer.wo.forward(&attn, m);
            add_into(&mut x, &o);

            let h = rms_norm_rows(&x, &layer.ffn_norm, cfg.eps);
            let gate = layer.w_gate.forward(&h, m);
            let up = layer.w_up.forward(&h, m);
            let act: Vec<f32> =
                gate.iter().zip(&up).map(|(&g, &u)| g / (1.0 + fastmath::exp(-g)) * u).collect();
            let down = layer.w_down.forward(&act, m);
            add_into(&mut x, &down);
        }
        for part in parts.iter_mut() {
            part.cache.len += part.tokens.len();
        }
        x
    }
}

/// One cache's share of a batched forward pass: the tokens appended to it.
pub struct Part<'a> {
    pub cache: &'a mut KvCache,
    pub tokens: &'a [u32],
}

/// Dot product with eight fixed accumulators: vectorisable, and the same order for every call.
#[inline]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(d) {
        let scale = 1.0 / (dot(row, row) / d as f32 + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(&v, &g)| v * scale * g));
    }
    out
}

fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in x.chunks_mut(b.len()) {
            add_into(row, b);
        }
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// cos/sin for the rotary pairs of `m` consecutive positions.
struct RopeTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
}

impl RopeTable {
    fn new(cfg: &Config, start: usize, m: usize) -> Self {
        let half = cfg.rope_dim / 2;
        let (mut cos, mut sin) = (Vec::with_capacity(m * half), Vec::with_capacity(m * half));
        for p in start..start + m {
            for &f in &cfg.inv_freq {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Self { cos, sin, half }
    }

    /// Rotates each head of each row of `x` (`[m][n_heads][head_dim]`).
    fn apply(&self, x: &mut [f32], n_heads: usize, cfg: &Config) {
        let hd = cfg.head_dim;
        for (r, row) in x.chunks_mut(n_heads * hd).enumerate() {
            let (cos, sin) = (
                &self.cos[r * self.half..(r + 1) * self.half],
                &self.sin[r * self.half..(r + 1) * self.half],
            );
            for head in row.chunks_mut(hd) {
                for i in 0..self.half {
                    let (a, b) = match cfg.rope_style {
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                        RopeStyle::Neox => (i, i + self.half),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cos[i] - x1 * sin[i];
                    head[b] = x0 * sin[i] + x1 * cos[i];
                }
            }
        }
    }
}
