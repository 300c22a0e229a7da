//! The compact binary form of `/verify` (content type [`BINARY_CONTENT_TYPE`]), the same messages as
//! the JSON in [`crate::protocol`] in a fraction of the bytes.
//!
//! Integers are LEB128 varints unless said otherwise; floats are little-endian IEEE 754 `f32`.
//!
//! Request: version `1` (byte); flags (byte: 1 session id, 2 top_logprobs, 4 penalties, 8 sampled,
//! 16 grammar);
//! [session id: length, bytes]; context_start; context: count, ids; [sampled (else greedy):
//! temperature (f32), top_p (f32), top_k, min_p (f32), seed (u64 LE)]; [top_logprobs (byte)];
//! [penalties: length, JSON]; [grammar: length, JSON]; drafts: count, then per draft its token and its q:
//! `0` (all mass on the token), `1` + entries (count, then per entry the id's distance from the
//! previous id and its units of 1/4096), or `2` + entries (count, then id distance and `f32`).
//!
//! Response: accepted; next_token; flags (byte: 1 bonus (else correction), 2 eos, 4 logprobs, 8
//! cached tokens); session_len; [cached_tokens]; queue and forward time in microseconds; [logprobs:
//! length, JSON].
//!
//! Quantised q (multiples of 1/4096, [`crate::dist::Q_UNITS`]) costs about 3 bytes per entry; a
//! greedy draft token 1–3 bytes.

use thiserror::Error;

use crate::dist::{SparseDist, Q_UNITS};
use crate::protocol::{VerifyRequest, VerifyResponse, VerifyTiming, WireDraftToken};
use crate::sampling::SamplingParams;
use crate::verify::NextKind;

/// The content type of binary `/verify` bodies (both ways).
pub const BINARY_CONTENT_TYPE: &str = "application/x-spade-verify";

const VERSION: u8 = 1;

#[derive(Debug, Clone, PartialEq, Error)]
pub enum WireError {
    #[error("the body ends early")]
    Truncated,
    #[error("unknown version {0} of the binary /verify body")]
    Version(u8),
    #[error("{0}")]
    Invalid(String),
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn bytes_field(out: &mut Vec<u8>, bytes: &[u8]) {
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.data.len() < n {
            return Err(WireError::Truncated);
        }
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Ok(head)
    }

    fn byte(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    fn varint(&mut self) -> Result<u64, WireError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(WireError::Invalid("a varint is longer than 64 bits".into()))
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        u32::try_from(self.varint()?)
            .map_err(|_| WireError::Invalid("a number does not fit 32 bits".into()))
    }

    /// A count of items each at least `min_bytes` long: bounded by what is left, so a forged count
    /// cannot make the reader allocate more than the body.
    fn count(&mut self, min_bytes: usize) -> Result<usize, WireError> {
        let n = self.varint()? as usize;
        if n.saturating_mul(min_bytes) > self.data.len() {
            return Err(WireError::Truncated);
        }
        Ok(n)
    }

    fn f32(&mut self) -> Result<f32, WireError> {
        Ok(f32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn bytes(&mut self) -> Result<&'a [u8], WireError> {
        let n = self.count(1)?;
        self.take(n)
    }

    fn json<T: serde::de::DeserializeOwned>(&mut self, what: &str) -> Result<T, WireError> {
        serde_json::from_slice(self.bytes()?)
            .map_err(|e| WireError::Invalid(format!("{what}: {e}")))
    }

    fn end(&self) -> Result<(), WireError> {
        if self.data.is_empty() {
            Ok(())
        } else {
            Err(WireError::Invalid(format!(
                "{} bytes after the end of the message",
                self.data.len()
            )))
        }
    }
}

/// Ids in increasing order as distances from the previous one (the first from 0).
fn ids_with<T: Copy>(
    out: &mut Vec<u8>,
    entries: &[(u32, T)],
    mut value: impl FnMut(&mut Vec<u8>, T),
) {
    varint(out, entries.len() as u64);
    let mut previous = 0;
    for &(id, v) in entries {
        varint(out, u64::from(id - previous));
        previous = id;
        value(out, v);
    }
}

pub fn encode_request(r: &VerifyRequest) -> Vec<u8> {
    let mut out = vec![VERSION];
    let s = &r.sampling;
    let flags = u8::from(r.session_id.is_some())
        | u8::from(r.top_logprobs.is_some()) << 1
        | u8::from(r.penalties.is_some()) << 2
        | u8::from(!s.is_greedy()) << 3
        | u8::from(r.grammar.is_some()) << 4;
    out.push(flags);
    if let Some(id) = &r.session_id {
        bytes_field(&mut out, id.as_bytes());
    }
    varint(&mut out, u64::from(r.context_start));
    varint(&mut out, r.context.len() as u64);
    for &t in &r.context {
        varint(&mut out, u64::from(t));
    }
    if !s.is_greedy() {
        out.extend_from_slice(&s.temperature.to_le_bytes());
        out.extend_from_slice(&s.top_p.to_le_bytes());
        varint(&mut out, u64::from(s.top_k));
        out.extend_from_slice(&s.min_p.to_le_bytes());
        out.extend_from_slice(&r.seed.to_le_bytes());
    }
    if let Some(n) = r.top_logprobs {
        out.push(n);
    }
    if let Some(p) = &r.penalties {
        bytes_field(&mut out, &serde_json::to_vec(p).expect("penalties serialise"));
    }
    if let Some(g) = &r.grammar {
        bytes_field(&mut out, &serde_json::to_vec(g).expect("grammars serialise"));
    }
    varint(&mut out, r.draft.len() as u64);
    for d in &r.draft {
        varint(&mut out, u64::from(d.token));
        let q = SparseDist::new(d.q.clone(), None).ok();
        match q.as_ref().and_then(SparseDist::counts) {
            Some(counts) if counts == [(d.token, Q_UNITS)] => out.push(0),
            Some(counts) => {
                out.push(1);
                ids_with(&mut out, &counts, |out, c| varint(out, u64::from(c)));
            }
            None => {
                out.push(2);
                let mut entries = d.q.clone();
                entries.sort_by_key(|e| e.0);
                ids_with(&mut out, &entries, |out, p| out.extend_from_slice(&p.to_le_bytes()));
            }
        }
    }
    out
}

pub fn decode_request(body: &[u8]) -> Result<VerifyRequest, WireError> {
    let mut r = Reader { data: body };
    let version = r.byte()?;
    if version != VERSION {
        return Err(WireError::Version(version));
    }
    let flags = r.byte()?;
    let session_id = if flags & 1 != 0 {
        Some(
            String::from_utf8(r.bytes()?.to_vec())
                .map_err(|_| WireError::Invalid("session_id is not UTF-8".into()))?,
        )
    } else {
        None
    };
    let context_start = r.u32()?;
    let n = r.count(1)?;
    let context = (0..n).map(|_| r.u32()).collect::<Result<_, _>>()?;
    let (sampling, seed) = if flags & 8 == 0 {
        (SamplingParams::greedy(), 0)
    } else {
        let temperature = r.f32()?;
        let top_p = r.f32()?;
        let top_k = r.u32()?;
        let min_p = r.f32()?;
        let seed = u64::from_le_bytes(r.take(8)?.try_into().expect("8 bytes"));
        (SamplingParams { temperature, top_p, top_k, min_p }, seed)
    };
    let top_logprobs = if flags & 2 != 0 { Some(r.byte()?) } else { None };
    let penalties = if flags & 4 != 0 { Some(r.json("penalties")?) } else { None };
    let grammar = if flags & 16 != 0 { Some(r.json("grammar")?) } else { None };
    let n = r.count(2)?;
    let mut draft = Vec::with_capacity(n);
    for _ in 0..n {
        let token = r.u32()?;
        let q = match r.byte()? {
            0 => vec![(token, 1.0)],
            kind @ (1 | 2) => {
                let entries = r.count(2)?;
                let mut q = Vec::with_capacity(entries);
                let mut id = 0u32;
                for _ in 0..entries {
                    id = id
                        .checked_add(r.u32()?)
                        .ok_or_else(|| WireError::Invalid("a q id overflows".into()))?;
                    let p = if kind == 1 { r.u32()? as f32 / Q_UNITS as f32 } else { r.f32()? };
                    q.push((id, p));
                }
                q
            }
            other => return Err(WireError::Invalid(format!("unknown q encoding {other}"))),
        };
        draft.push(WireDraftToken { token, q });
    }
    r.end()?;
    Ok(VerifyRequest {
        session_id,
        context,
        context_start,
        draft,
        sampling,
        penalties,
        grammar,
        seed,
        top_logprobs,
    })
}

pub fn encode_response(r: &VerifyResponse) -> Vec<u8> {
    let mut out = Vec::with_capacity(24);
    varint(&mut out, u64::from(r.accepted));
    varint(&mut out, u64::from(r.next_token));
    let cached = r.cached_tokens > 0;
    out.push(
        u8::from(r.next_kind == NextKind::Bonus)
            | u8::from(r.eos) << 1
            | u8::from(r.logprobs.is_some()) << 2
            | u8::from(cached) << 3,
    );
    varint(&mut out, u64::from(r.session_len));
    if cached {
        varint(&mut out, u64::from(r.cached_tokens));
    }
    for ms in [r.timing.queue_ms, r.timing.forward_ms] {
        varint(&mut out, (ms.max(0.0) * 1e3).round() as u64);
    }
    if let Some(lp) = &r.logprobs {
        bytes_field(&mut out, &serde_json::to_vec(lp).expect("logprobs serialise"));
    }
    out
}

pub fn decode_response(body: &[u8]) -> Result<VerifyResponse, WireError> {
    let mut r = Reader { data: body };
    let accepted = r.u32()?;
    let next_token = r.u32()?;
    let flags = r.byte()?;
    let session_len = r.u32()?;
    let cached_tokens = if flags & 8 != 0 { r.u32()? } else { 0 };
    let timing =
        VerifyTiming { queue_ms: r.varint()? as f64 / 1e3, forward_ms: r.varint()? as f64 / 1e3 };
    let logprobs = if flags & 4 != 0 { Some(r.json("logprobs")?) } else { None };
    r.end()?;
    let next_kind = if flags & 1 != 0 { NextKind::Bonus } else { NextKind::Correction };
    Ok(VerifyResponse {
        accepted,
        next_token,
        next_kind,
        eos: flags & 2 != 0,
        session_len,
        cached_tokens,
        logprobs,
        timing,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::GrammarConstraint;
    use crate::penalties::Penalties;
    use crate::protocol::TokenLogprob;

    fn request(sampling: SamplingParams, draft: Vec<WireDraftToken>) -> VerifyRequest {
        VerifyRequest {
            session_id: Some("gw-0123".into()),
            context: vec![1, 151_000, 300],
            context_start: 42,
            draft,
            sampling,
            penalties: None,
            grammar: None,
            seed: if sampling.is_greedy() { 0 } else { 77 },
            top_logprobs: None,
        }
    }

    #[test]
    fn requests_round_trip_greedy_quantised_and_raw() {
        let greedy = request(
            SamplingParams::greedy(),
            vec![
                WireDraftToken { token: 5, q: vec![(5, 1.0)] },
                WireDraftToken { token: 70_000, q: vec![(70_000, 1.0)] },
            ],
        );
        let bytes = encode_request(&greedy);
        assert_eq!(decode_request(&bytes).unwrap(), greedy);
        assert!(bytes.len() < 26, "{} bytes for a greedy call with two drafts", bytes.len());

        let q =
            SparseDist::new(vec![(9, 0.6), (150_000, 0.3), (11, 0.1)], None).unwrap().quantized();
        let sampled = VerifyRequest {
            top_logprobs: Some(3),
            penalties: Some(Penalties {
                presence_penalty: 0.5,
                prompt_len: 3,
                ..Penalties::default()
            }),
            grammar: Some(GrammarConstraint::json_schema(serde_json::json!({"type": "object"}), 3)),
            ..request(
                SamplingParams { temperature: 0.8, top_p: 0.9, top_k: 40, min_p: 0.05 },
                vec![WireDraftToken { token: 9, q: q.entries().to_vec() }],
            )
        };
        assert_eq!(decode_request(&encode_request(&sampled)).unwrap(), sampled);
        let raw = request(
            SamplingParams::default(),
            vec![WireDraftToken { token: 2, q: vec![(7, 0.3), (2, 0.7)] }],
        );
        let back = decode_request(&encode_request(&raw)).unwrap();
        assert_eq!(
            back.draft[0].q,
            vec![(2, 0.7), (7, 0.3)],
            "raw q comes back exactly, sorted by id"
        );
    }

    #[test]
    fn responses_round_trip() {
        let mut r = VerifyResponse {
            accepted: 3,
            next_token: 151_643,
            next_kind: NextKind::Bonus,
            eos: true,
            session_len: 517,
            cached_tokens: 0,
            logprobs: None,
            timing: VerifyTiming { queue_ms: 0.5, forward_ms: 120.25 },
        };
        assert_eq!(decode_response(&encode_response(&r)).unwrap(), r);
        assert!(encode_response(&r).len() <= 12, "{} bytes", encode_response(&r).len());
        r.logprobs =
            Some(vec![TokenLogprob { token: 4, logprob: -0.25, top: vec![(4, -0.25), (8, -2.0)] }]);
        r.next_kind = NextKind::Correction;
        assert_eq!(decode_response(&encode_response(&r)).unwrap(), r);
        r.cached_tokens = 1_900;
        assert_eq!(decode_response(&encode_response(&r)).unwrap(), r);
    }

    #[test]
    fn malformed_bodies_are_errors_not_panics() {
        let good = encode_request(&request(
            SamplingParams::greedy(),
            vec![WireDraftToken { token: 5, q: vec![(5, 1.0)] }],
        ));
        for cut in 0..good.len() {
            assert!(decode_request(&good[..cut]).is_err(), "cut at {cut}");
        }
        assert_eq!(decode_request(&[9]), Err(WireError::Version(9)));
        let mut long = good.clone();
        long.push(0);
        assert!(decode_request(&long).is_err());
        // A forged count larger than the body is refused before anything is allocated.
        assert_eq!(
            decode_request(&[1, 0, 0, 0xff, 0xff, 0xff, 0xff, 0x0f]),
            Err(WireError::Truncated)
        );
        let mut junk = 0x2545F4914F6CDD1Du64;
        for _ in 0..2000 {
            let bytes: Vec<u8> = (0..24)
                .map(|_| {
                    junk ^= junk << 13;
                    junk ^= junk >> 7;
                    junk ^= junk << 17;
                    junk as u8
                })
                .collect();
            let _ = decode_request(&bytes);
            let _ = decode_response(&bytes);
        }
    }
}
