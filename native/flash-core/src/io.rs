//! The host buffers of one call, named: native-endian, row-major, contiguous bytes whose sizes
//! the call's [`Problem`](crate::Problem) implies (checked by every backend before it reads them);
//! with `strides`, the inputs' rows lie where those say instead (a view; the CPU backend reads it
//! in place).
//! The CUDA backend's device-pointer twins are `cuda::ForwardPtrs` / `cuda::BackwardPtrs`.
//! Shapes below are a padded call's; a varlen call's are [`Problem::q_shape`](crate::Problem::q_shape)
//! and friends.

use crate::mask::MaskBuffers;
use crate::strides::InputStrides;

/// Forward: reads q, k, v in `p.dtype`; writes o (`p.dtype`) and lse (f32, natural log).
#[derive(Debug)]
pub struct ForwardIo<'a> {
    pub q: &'a [u8],       // [B, Sq, H, D]
    pub k: &'a [u8],       // [B, Sk, Hkv, D]
    pub v: &'a [u8],       // [B, Sk, Hkv, Dv]
    pub o: &'a mut [u8],   // [B, Sq, H, Dv]
    pub lse: &'a mut [u8], // [B, H, Sq]
    /// Segment ids and block mask, when the problem has them.
    pub mask: MaskBuffers<'a>,
    /// Where q, k and v's rows lie in their buffers; `None`: packed (outputs always are).
    pub strides: Option<InputStrides>,
}

/// Backward: reads the forward's inputs, its o and lse, and d_out (the gradient of o); writes
/// dq, dk, dv in `p.dtype` (dk and dv sum over each kv head's group of query heads).
#[derive(Debug)]
pub struct BackwardIo<'a> {
    pub d_out: &'a [u8],  // [B, Sq, H, Dv]
    pub q: &'a [u8],      // [B, Sq, H, D]
    pub k: &'a [u8],      // [B, Sk, Hkv, D]
    pub v: &'a [u8],      // [B, Sk, Hkv, Dv]
    pub o: &'a [u8],      // [B, Sq, H, Dv]
    pub lse: &'a [u8],    // [B, H, Sq], f32
    pub dq: &'a mut [u8], // [B, Sq, H, D]
    pub dk: &'a mut [u8], // [B, Sk, Hkv, D]
    pub dv: &'a mut [u8], // [B, Sk, Hkv, Dv]
    /// The forward's segment ids and block mask, when the problem has them.
    pub mask: MaskBuffers<'a>,
    /// Where d_out, q, k, v and o's rows lie in their buffers; `None`: packed (outputs always are).
    pub strides: Option<InputStrides>,
    /// With sinks: receives dsinks, f32 [H] (summed over batch rows and query rows).
    pub dsinks: Option<&'a mut [u8]>,
    /// Optional gradient of the loss with respect to lse, f32 like lse ([B, H, Sq]): it enters
    /// every row as delta - dlse (d lse / d s_j = P_j). Rows that see no key ignore it.
    pub dlse: Option<&'a [u8]>,
}

impl<'a> ForwardIo<'a> {
    /// From the buffers in argument order: inputs [q, k, v], outputs [o, lse].
    pub fn new([q, k, v]: [&'a [u8]; 3], [o, lse]: [&'a mut [u8]; 2]) -> Self {
        ForwardIo { q, k, v, o, lse, mask: MaskBuffers::default(), strides: None }
    }

    /// The same buffers with the call's mask data.
    pub fn with_mask(self, mask: MaskBuffers<'a>) -> Self {
        ForwardIo { mask, ..self }
    }

    /// The same buffers, the inputs' rows where `strides` say.
    pub fn with_strides(self, strides: InputStrides) -> Self {
        ForwardIo { strides: Some(strides), ..self }
    }
}

impl<'a> BackwardIo<'a> {
    /// From the buffers in argument order: inputs [d_out, q, k, v, o, lse], outputs [dq, dk, dv].
    pub fn new([d_out, q, k, v, o, lse]: [&'a [u8]; 6], [dq, dk, dv]: [&'a mut [u8]; 3]) -> Self {
        BackwardIo { d_out, q, k, v, o, lse, dq, dk, dv, mask: MaskBuffers::default(), dsinks: None, dlse: None, strides: None }
    }

    /// The same buffers with the forward's mask data.
    pub fn with_mask(self, mask: MaskBuffers<'a>) -> Self {
        BackwardIo { mask, ..self }
    }

    /// The same buffers, the inputs' rows where `strides` say.
    pub fn with_strides(self, strides: InputStrides) -> Self {
        BackwardIo { strides: Some(strides), ..self }
    }

    /// The same buffers with the gradient of lse (f32, lse's shape).
    pub fn with_dlse(self, dlse: &'a [u8]) -> Self {
        BackwardIo { dlse: Some(dlse), ..self }
    }

    /// The same buffers with dsinks' output (f32 [H]; required when the problem has sinks).
    pub fn with_dsinks(self, dsinks: &'a mut [u8]) -> Self {
        BackwardIo { dsinks: Some(dsinks), ..self }
    }
}
