//! What a specialised kernel is: its kernel, dtype and head dim, source file, tiles and -D defines,
//! and its stable name. Which variant a launch gets is config.rs's decision.

use crate::dtype::DType;
use crate::error::{FlashError, Result};

/// The kernels of a forward + backward, and Rotary. The default backward is BwdPreprocess, BwdDkdvDq
/// (dK, dV and dQ by f32 atomics), BwdDqConvert; the deterministic one is BwdPreprocess, BwdDq, BwdDkdv.
/// Pad copies tensors to and from the kernels' head dim when a call's is not theirs (pad.rs).
/// Decode over a KV cache: Decode or DecodeSimt, then MergeStates for split keys (decode.rs);
/// QuantizeKv / DequantizeKv convert caches (kv.rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    Fwd,
    /// The Hopper forward (sm_90a only: wgmma, the tensor copy engine; sm90.rs decides when).
    FwdSm90,
    /// The Hopper backward: dK, dV and dQ (bulk-reduced into dq_accum) in one kernel (sm_90a only);
    /// in f32 dK and dV only (cuda/bwd_dkdv_sm90_f32.cu), dQ coming from [`Kernel::BwdDqSm90`].
    BwdSm90,
    /// The Hopper f32 backward's dQ (cuda/bwd_dq_sm90_f32.cu, sm_90a only): a block per query tile.
    BwdDqSm90,
    BwdPreprocess,
    BwdDq,
    BwdDkdv,
    /// bwd_dkdv with ATOMIC_DQ=1.
    BwdDkdvDq,
    BwdDqConvert,
    /// The attention sinks' gradient (problems with sinks only).
    BwdDsinks,
    /// Zero-filled copies to the kernels' head dim (HEAD_DIM) and back (pad.rs).
    Pad,
    /// Rotary embeddings, forward and backward (cuda/rotary.cu); its head dim is a run-time value.
    Rotary,
    /// Decode on tensor cores (cuda/decode.cu): fp16 / bf16 at head dims 64, 128, 256.
    Decode,
    /// Decode on CUDA cores (cuda/decode_simt.cu): every dtype, the head dim at run time.
    DecodeSimt,
    /// Merging partial attention states by their logsumexp (cuda/merge.cu).
    MergeStates,
    /// The KV cache's 4- / 8-bit format, to and from (cuda/quantize_kv.cu, cuda/dequantize_kv.cu).
    QuantizeKv,
    DequantizeKv,
}

impl Kernel {
    pub const ALL: [Kernel; 17] = [
        Kernel::Fwd,
        Kernel::FwdSm90,
        Kernel::BwdSm90,
        Kernel::BwdDqSm90,
        Kernel::BwdPreprocess,
        Kernel::BwdDq,
        Kernel::BwdDkdv,
        Kernel::BwdDkdvDq,
        Kernel::BwdDqConvert,
        Kernel::BwdDsinks,
        Kernel::Pad,
        Kernel::Rotary,
        Kernel::Decode,
        Kernel::DecodeSimt,
        Kernel::MergeStates,
        Kernel::QuantizeKv,
        Kernel::DequantizeKv,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Fwd => "fwd",
            Kernel::FwdSm90 => "fwd_sm90",
            Kernel::BwdSm90 => "bwd_sm90",
            Kernel::BwdDqSm90 => "bwd_dq_sm90",
            Kernel::BwdPreprocess => "bwd_preprocess",
            Kernel::BwdDq => "bwd_dq",
            Kernel::BwdDkdv => "bwd_dkdv",
            Kernel::BwdDkdvDq => "bwd_dkdv_dq",
            Kernel::BwdDqConvert => "bwd_dq_convert",
            Kernel::BwdDsinks => "bwd_dsinks",
            Kernel::Pad => "pad",
            Kernel::Rotary => "rotary",
            Kernel::Decode => "decode",
            Kernel::DecodeSimt => "decode_simt",
            Kernel::MergeStates => "merge_states",
            Kernel::QuantizeKv => "quantize_kv",
            Kernel::DequantizeKv => "dequantize_kv",
        }
    }

    /// The kernel named `name` (as [`Kernel::name`] spells it).
    pub fn parse(name: &str) -> Result<Kernel> {
        Kernel::ALL.into_iter().find(|k| k.name() == name).ok_or_else(|| {
            let names: Vec<_> = Kernel::ALL.iter().map(|k| k.name()).collect();
            FlashError::Unsupported(format!("unknown kernel {name:?}; expected one of {}", names.join(", ")))
        })
    }

    /// The `extern "C" __global__` function in its source.
    pub fn entry(self) -> &'static str {
        match self {
            Kernel::Fwd => "flash_fwd",
            Kernel::FwdSm90 => "flash_fwd_sm90",
            Kernel::BwdSm90 => "flash_bwd_sm90",
            Kernel::BwdDqSm90 => "flash_bwd_dq_sm90",
            Kernel::BwdPreprocess => "flash_bwd_preprocess",
            Kernel::BwdDq => "flash_bwd_dq",
            Kernel::BwdDkdv | Kernel::BwdDkdvDq => "flash_bwd_dkdv",
            Kernel::BwdDqConvert => "flash_bwd_dq_convert",
            Kernel::BwdDsinks => "flash_bwd_dsinks",
            Kernel::Pad => "flash_pad",
            Kernel::Rotary => "flash_rotary",
            Kernel::Decode => "flash_decode",
            Kernel::DecodeSimt => "flash_decode_simt",
            Kernel::MergeStates => "flash_merge_states",
            Kernel::QuantizeKv => "flash_quantize_kv",
            Kernel::DequantizeKv => "flash_dequantize_kv",
        }
    }

    /// Kernels that only sm_90a (Hopper) can run.
    pub fn is_sm90(self) -> bool {
        matches!(self, Kernel::FwdSm90 | Kernel::BwdSm90 | Kernel::BwdDqSm90)
    }

    /// Elementwise kernels have no tiles and no shared memory.
    pub fn is_elementwise(self) -> bool {
        matches!(
            self,
            Kernel::BwdPreprocess
                | Kernel::BwdDqConvert
                | Kernel::BwdDsinks
                | Kernel::Pad
                | Kernel::Rotary
                | Kernel::MergeStates
                | Kernel::QuantizeKv
                | Kernel::DequantizeKv
        )
    }

    /// The decode kernels: their tiles are config.rs's decode table, not the attention tables.
    pub fn is_decode(self) -> bool {
        matches!(self, Kernel::Decode | Kernel::DecodeSimt)
    }
}

/// The head dim of a variant that takes it at run time (the table and the golden snapshot list it
/// as 0).
pub const ANY_HEAD_DIM: usize = 0;

/// The dtype's short name in variant names ("f16", "bf16", "f32").
pub fn dtype_short(d: DType) -> &'static str {
    match d {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F32 => "f32",
    }
}

/// Launch shape of a tiled kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tiles {
    pub block_m: usize,
    pub block_n: usize,
    pub num_warps: usize,
    /// bwd_dkdv: warps sharing a key slice (D_SPLIT); fwd: 16-row tiles per warp (M_TILES);
    /// fwd_sm90: shared-memory stages of K and V (STAGES); bwd_sm90: of Q and dO (STAGES);
    /// bwd_dq_sm90: of K and V (STAGES).
    pub d_split: usize,
    /// Blocks per SM the register allocation must allow (MIN_BLOCKS).
    pub min_blocks: usize,
}

/// Which table a variant's tiles come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TileSet {
    /// The tuned tiles.
    Default,
    /// For GPUs whose blocks get less shared memory than the default asks for (sm_86 / sm_89).
    Small,
    /// Forced for this process by the development hook (tools/sweep*.py).
    Override,
}

impl TileSet {
    pub fn name(self) -> &'static str {
        match self {
            TileSet::Default => "default",
            TileSet::Small => "small",
            TileSet::Override => "override",
        }
    }
}

/// One specialised kernel.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Variant {
    pub kernel: Kernel,
    pub dtype: DType,
    /// [`ANY_HEAD_DIM`] for a kernel that takes the head dim at run time (Rotary).
    pub head_dim: usize,
    pub source: &'static str,
    pub tiles: Tiles,
    pub tile_set: TileSet,
    /// The -D defines NVRTC compiles it with; every one is part of the name.
    pub defines: Vec<(&'static str, i64)>,
}

impl Variant {
    /// How its products are computed: "f16" / "bf16" (tensor cores), and for f32 "3xtf32" (split
    /// TF32 on tensor cores, f32 accuracy), "3xf16" (split into fp16 parts of scaled operands, f32
    /// accuracy), "tf32" (one TF32 product), "1xf16" (one product of scaled fp16 operands: TF32's
    /// 11 bits) or "f32-simt" (f32 FMAs).
    pub fn math(&self) -> &'static str {
        if self.defines.iter().any(|(k, _)| *k == "F16_PARTS") {
            let exact = self.defines.iter().any(|&(k, v)| k == "TF32_TERMS" && v == 3);
            return if exact { "3xf16" } else { "1xf16" };
        }
        match (self.dtype, self.defines.iter().find(|(k, _)| *k == "TF32_TERMS").map(|(_, v)| *v)) {
            (DType::F32, Some(3)) => "3xtf32",
            (DType::F32, Some(_)) => "tf32",
            (DType::F32, None) => "f32-simt",
            (d, _) => dtype_short(d),
        }
    }

    pub fn threads(&self) -> u32 {
        32 * self.tiles.num_warps as u32
    }

    /// Stable name, e.g. `fwd_bf16_d128_num_warps4_is_causal1_...`: kernel, dtype, head dim (none for
    /// [`ANY_HEAD_DIM`]) and the other defines in order (the disk cache's file names and the golden
    /// snapshot use it).
    pub fn name(&self) -> String {
        let rest: Vec<String> = self
            .defines
            .iter()
            .filter(|(k, _)| *k != "FLASH_DTYPE" && *k != "HEAD_DIM")
            .map(|(k, v)| format!("{}{}", k.to_lowercase(), v))
            .collect();
        let (kernel, dtype) = (self.kernel.name(), dtype_short(self.dtype));
        match self.head_dim {
            ANY_HEAD_DIM => format!("{kernel}_{dtype}_{}", rest.join("_")),
            d => format!("{kernel}_{dtype}_d{d}_{}", rest.join("_")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_round_trip() {
        for k in Kernel::ALL {
            assert_eq!(Kernel::parse(k.name()).unwrap(), k);
        }
        assert!(Kernel::parse("fwd2").is_err());
    }
}
