//! Kernel variants: which source, which -D defines, which tile sizes and launch shape.
//! Mirrored by python/flash_nif/kernels.py (the compile check); tests/test_gpu.py compares them.

use crate::dtype::DType;

/// The kernels of a forward + backward. The default backward is BwdPreprocess, BwdDkdvDq (dK, dV and
/// dQ by f32 atomics), BwdDqConvert; the deterministic one is BwdPreprocess, BwdDq, BwdDkdv.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    Fwd,
    BwdPreprocess,
    BwdDq,
    BwdDkdv,
    /// bwd_dkdv with ATOMIC_DQ=1.
    BwdDkdvDq,
    BwdDqConvert,
}

impl Kernel {
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Fwd => "fwd",
            Kernel::BwdPreprocess => "bwd_preprocess",
            Kernel::BwdDq => "bwd_dq",
            Kernel::BwdDkdv => "bwd_dkdv",
            Kernel::BwdDkdvDq => "bwd_dkdv_dq",
            Kernel::BwdDqConvert => "bwd_dq_convert",
        }
    }
    pub fn entry(self) -> &'static str {
        match self {
            Kernel::Fwd => "flash_fwd",
            Kernel::BwdPreprocess => "flash_bwd_preprocess",
            Kernel::BwdDq => "flash_bwd_dq",
            Kernel::BwdDkdv | Kernel::BwdDkdvDq => "flash_bwd_dkdv",
            Kernel::BwdDqConvert => "flash_bwd_dq_convert",
        }
    }
}

pub fn dtype_code(d: DType) -> u32 {
    match d {
        DType::F16 => 0,
        DType::BF16 => 1,
        DType::F32 => 2,
    }
}

pub fn dtype_short(d: DType) -> &'static str {
    match d {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F32 => "f32",
    }
}

/// One specialised kernel.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Variant {
    pub kernel: Kernel,
    pub dtype: DType,
    pub head_dim: usize,
    pub source: &'static str,
    pub block_m: usize,
    pub block_n: usize,
    pub num_warps: usize,
    /// bwd_dkdv: warps sharing a key slice (D_SPLIT); fwd: 16-row tiles per warp (M_TILES).
    pub d_split: usize,
    pub defines: Vec<(&'static str, i64)>,
}

impl Variant {
    pub fn threads(&self) -> u32 {
        32 * self.num_warps as u32
    }

    /// Stable name, e.g. `fwd_bf16_d128_num_warps8_is_causal1_...` (same as kernels.py).
    pub fn name(&self) -> String {
        let rest: Vec<String> = self
            .defines
            .iter()
            .filter(|(k, _)| *k != "FLASH_DTYPE" && *k != "HEAD_DIM")
            .map(|(k, v)| format!("{}{}", k.to_lowercase(), v))
            .collect();
        format!("{}_{}_d{}_{}", self.kernel.name(), dtype_short(self.dtype), self.head_dim, rest.join("_"))
    }

    /// NVRTC options for `arch` (e.g. "sm_90a").
    pub fn options(&self, arch: &str) -> Vec<String> {
        let mut o = vec![format!("-arch={arch}"), "-std=c++17".to_string(), "-default-device".to_string()];
        o.extend(self.defines.iter().map(|(k, v)| format!("-D{k}={v}")));
        o
    }

    /// Dynamic shared memory in bytes (the layouts in cuda/*.cu).
    pub fn smem_bytes(&self) -> usize {
        let (d, bm, bn) = (self.head_dim, self.block_m, self.block_n);
        match (self.kernel, self.dtype) {
            (Kernel::BwdPreprocess | Kernel::BwdDqConvert, _) => 0,
            (Kernel::Fwd, DType::F32) if simt_f32(d) => 4 * (bm * (d + 4) + bn * (d + 4) + bn * d + bm * (bn + 16)),
            (Kernel::BwdDq, DType::F32) if simt_f32(d) => 4 * ((2 * bm + 3 * bn) * (d + 4) + bm * (bn + 16)),
            (Kernel::BwdDkdv | Kernel::BwdDkdvDq, DType::F32) if simt_f32(d) => 4 * (2 * (bn + bm) * (d + 4) + 2 * bn * (bm + 16) + 2 * bm),
            (k, DType::F32) => {
                let fs = d + 1;
                4 * match k {
                    Kernel::Fwd => (bm + 2 * bn) * fs + bm * (bn + 1),
                    Kernel::BwdDq => (2 * bm + 2 * bn) * fs + bm * (bn + 1),
                    _ => (2 * bn + 2 * bm) * fs + 2 * bn * (bm + 1) + 2 * bm,
                }
            }
            (k, _) => {
                let unit = if k == Kernel::BwdDq || k == Kernel::Fwd { 16 } else { 16 * self.d_split };
                let srow = d.div_ceil(unit) * unit + 8;
                match k {
                    Kernel::Fwd => 2 * (bm + 4 * bn) * srow,
                    Kernel::BwdDq => 2 * (2 * bm + 4 * bn) * srow,
                    Kernel::BwdDkdv => 2 * (2 * bn + 4 * bm) * srow + 16 * bm,
                    // + dS^T [bn][bm + 8]
                    _ => 2 * (2 * bn + 4 * bm) * srow + 16 * bm + 2 * bn * (bm + 8),
                }
            }
        }
    }
}

/// (block_m, block_n, num_warps, d_split, min_blocks) per kernel, dtype and head dim. Chosen by
/// cuda/sweep.py on an H100 (bench/RESULTS.md has the numbers); min_blocks = 2 caps the forward at
/// 128 registers so that two 8-warp blocks share an SM.
pub fn tiles(kernel: Kernel, dtype: DType, d: usize) -> (usize, usize, usize, usize, usize) {
    if kernel == Kernel::BwdPreprocess || kernel == Kernel::BwdDqConvert {
        return (8, 1, 8, 1, 1);
    }
    // The atomic-dQ dK/dV kernel takes 128 keys per block on 8 warps (the deterministic one: 64 on
    // 4): half the dQ atomics per query, and 8 warps per SM at D = 128 where 4-warp blocks of
    // 115 KiB fit only once. Measured +4-10 % backward on an H100 (bench/RESULTS.md).
    if kernel == Kernel::BwdDkdvDq && dtype != DType::F32 && d <= 128 {
        return if d <= 64 { (96, 128, 8, 1, 1) } else { (64, 128, 8, 1, 1) };
    }
    let kernel = if kernel == Kernel::BwdDkdvDq { Kernel::BwdDkdv } else { kernel };
    if dtype == DType::F32 {
        let (bm, bn) = match kernel {
            Kernel::Fwd if simt_f32(d) => (128, if d <= 64 { 128 } else { 64 }),
            Kernel::Fwd if d <= 64 => (128, 64),
            Kernel::Fwd if d <= 128 => (64, 64),
            Kernel::Fwd => (32, 16),
            Kernel::BwdDq if simt_f32(d) => (if d <= 64 { 128 } else { 64 }, 64),
            Kernel::BwdDkdv if simt_f32(d) => (64, if d <= 64 { 128 } else { 64 }),
            Kernel::BwdDq if d <= 64 => (64, 64),
            Kernel::BwdDq if d <= 128 => (64, 32),
            Kernel::BwdDkdv if d <= 128 => (64, 64),
            _ => (16, 16),
        };
        return (bm, bn, 8, 1, 1);
    }
    match kernel {
        // The forward's 4th value is M_TILES: 16-row tiles per warp (2 = each K/V fragment read
        // from shared memory feeds two mma's).
        Kernel::Fwd if d <= 64 => (128, 64, 4, 2, 1),
        Kernel::Fwd if d <= 128 => (128, 32, 4, 2, 1),
        Kernel::Fwd => (64, 32, 4, 1, 1),
        Kernel::BwdDq if d <= 64 => (64, 128, 4, 1, 1),
        Kernel::BwdDq if d <= 128 => (64, 64, 4, 1, 1),
        Kernel::BwdDq => (64, 32, 4, 1, 1),
        _ if d <= 64 => (96, 64, 4, 1, 1), // 128 x 64 needs 255 regs and spills on sm_80 (NVRTC 13.5)
        _ if d <= 128 => (64, 64, 4, 1, 1),
        _ => (32, 64, 8, 2, 1),
    }
}

/// Tiles for GPUs whose blocks get less shared memory than [`tiles`] asks for (sm_86 / sm_89:
/// 99 KiB): every variant here needs at most 99 KiB (101376 bytes).
pub fn small_tiles(kernel: Kernel, dtype: DType, d: usize) -> (usize, usize, usize, usize, usize) {
    if kernel == Kernel::BwdPreprocess || kernel == Kernel::BwdDqConvert {
        return tiles(kernel, dtype, d);
    }
    let kernel = if kernel == Kernel::BwdDkdvDq { Kernel::BwdDkdv } else { kernel };
    if dtype == DType::F32 {
        let (bm, bn) = match kernel {
            Kernel::Fwd if d <= 64 => (64, 64),
            Kernel::Fwd if d <= 128 => (64, 32),
            Kernel::Fwd => (32, 16),
            Kernel::BwdDkdv if simt_f32(d) => (64, if d <= 64 { 32 } else { 16 }),
            Kernel::BwdDq if simt_f32(d) => if d <= 64 { (64, 32) } else { (32, 32) },
            _ if d <= 64 => (64, 64),
            _ if d <= 128 => (32, 32),
            _ => (16, 16),
        };
        return (bm, bn, 8, 1, 1);
    }
    match kernel {
        Kernel::Fwd if d <= 128 => tiles(kernel, dtype, d),
        Kernel::Fwd => (32, 32, 2, 1, 1),
        Kernel::BwdDq if d <= 64 => tiles(kernel, dtype, d),
        Kernel::BwdDq if d <= 128 => (64, 32, 4, 1, 1),
        Kernel::BwdDq => (32, 32, 2, 1, 1),
        _ if d <= 64 => tiles(kernel, dtype, d),
        _ if d <= 128 => (32, 64, 4, 1, 1),
        _ => (16, 32, 4, 2, 1),
    }
}

/// Head dims with the fast fp32 SIMT kernels (cuda/simt_f32.h); other head dims use the generic ones.
pub fn simt_f32(d: usize) -> bool {
    d % 64 == 0 && d <= 128
}

fn source(kernel: Kernel, dtype: DType, d: usize) -> &'static str {
    match (kernel, dtype) {
        (Kernel::Fwd, DType::F32) if simt_f32(d) => "fwd_f32_simt.cu",
        (Kernel::Fwd, DType::F32) => "fwd_f32.cu",
        (Kernel::BwdDkdv | Kernel::BwdDkdvDq, DType::F32) if simt_f32(d) => "bwd_dkdv_f32_simt.cu",
        (Kernel::BwdDq, DType::F32) if simt_f32(d) => "bwd_dq_f32_simt.cu",
        (Kernel::BwdDq, DType::F32) => "bwd_dq_f32.cu",
        (Kernel::BwdDkdv | Kernel::BwdDkdvDq, DType::F32) => "bwd_dkdv_f32.cu",
        (Kernel::Fwd, _) => "fwd.cu",
        (Kernel::BwdDq, _) => "bwd_dq.cu",
        (Kernel::BwdDkdv | Kernel::BwdDkdvDq, _) => "bwd_dkdv.cu",
        (Kernel::BwdPreprocess, _) => "bwd_preprocess.cu",
        (Kernel::BwdDqConvert, _) => "bwd_dq_convert.cu",
    }
}

/// The variant launched for a kernel of a problem. `even_m` / `even_n`: Sq / Sk divide the tiles.
pub fn variant(kernel: Kernel, dtype: DType, head_dim: usize, causal: bool, group: usize, seq_q: usize, seq_k: usize) -> Variant {
    make_variant(tiles(kernel, dtype, head_dim), kernel, dtype, head_dim, causal, group, seq_q, seq_k)
}

/// [`variant`], falling back to [`small_tiles`] when the default needs more than `max_smem`
/// bytes of shared memory per block.
#[allow(clippy::too_many_arguments)]
pub fn variant_for(
    max_smem: usize,
    kernel: Kernel,
    dtype: DType,
    head_dim: usize,
    causal: bool,
    group: usize,
    seq_q: usize,
    seq_k: usize,
) -> Variant {
    let v = variant(kernel, dtype, head_dim, causal, group, seq_q, seq_k);
    if v.smem_bytes() <= max_smem {
        return v;
    }
    make_variant(small_tiles(kernel, dtype, head_dim), kernel, dtype, head_dim, causal, group, seq_q, seq_k)
}

#[allow(clippy::too_many_arguments)]
fn make_variant(
    t: (usize, usize, usize, usize, usize),
    kernel: Kernel,
    dtype: DType,
    head_dim: usize,
    causal: bool,
    group: usize,
    seq_q: usize,
    seq_k: usize,
) -> Variant {
    let (bm, bn, nw, ds, min_blocks) = t;
    let mut defines: Vec<(&'static str, i64)> =
        vec![("FLASH_DTYPE", dtype_code(dtype) as i64), ("HEAD_DIM", head_dim as i64), ("NUM_WARPS", nw as i64)];
    if kernel != Kernel::BwdPreprocess && kernel != Kernel::BwdDqConvert {
        defines.extend([
            ("IS_CAUSAL", causal as i64),
            ("GQA_GROUP", group as i64),
            ("BLOCK_M", bm as i64),
            ("BLOCK_N", bn as i64),
            ("EVEN_M", (seq_q % bm == 0) as i64),
            ("EVEN_N", (seq_k % bn == 0) as i64),
        ]);
        if (kernel == Kernel::BwdDkdv || kernel == Kernel::BwdDkdvDq) && dtype != DType::F32 {
            defines.push(("D_SPLIT", ds as i64));
        }
        if kernel == Kernel::BwdDkdvDq {
            defines.push(("ATOMIC_DQ", 1));
        }
        if kernel == Kernel::Fwd && dtype != DType::F32 {
            defines.push(("M_TILES", ds as i64));
        }
        defines.push(("MIN_BLOCKS", min_blocks as i64));
    }
    Variant { kernel, dtype, head_dim, source: source(kernel, dtype, head_dim), block_m: bm, block_n: bn, num_warps: nw, d_split: ds, defines }
}

/// Every (kernel, dtype, head dim, causal) the library launches, default and small-shared-memory
/// tiles, at GQA group 1 with ragged sizes (the group and EVEN_* flags change a loop bound or fold
/// a branch, not the code's shape).
pub fn all_variants(head_dims: &[usize]) -> Vec<Variant> {
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        for &d in head_dims {
            out.push(variant(Kernel::BwdPreprocess, dtype, d, false, 1, 1, 1));
            out.push(variant(Kernel::BwdDqConvert, dtype, d, false, 1, 1, 1));
            for k in [Kernel::Fwd, Kernel::BwdDq, Kernel::BwdDkdv, Kernel::BwdDkdvDq] {
                for causal in [false, true] {
                    let v = variant(k, dtype, d, causal, 1, 1, 1);
                    let small = make_variant(small_tiles(k, dtype, d), k, dtype, d, causal, 1, 1, 1);
                    out.push(v.clone());
                    if small != v {
                        out.push(small);
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fit_an_ampere_block_and_warps_cover_the_tile() {
        for v in all_variants(&(8..=256).step_by(8).collect::<Vec<_>>()) {
            // The largest opt-in block on an H100 is 227 KiB (A100: 163 KiB, where variant_for falls
            // back to small_tiles when the default needs more).
            assert!(v.smem_bytes() <= 227 * 1024, "{} needs {} bytes", v.name(), v.smem_bytes());
            if v.dtype != DType::F32 {
                match v.kernel {
                    Kernel::Fwd => assert_eq!(v.block_m, 16 * v.num_warps * v.d_split),
                    Kernel::BwdDq => assert_eq!(v.block_m, 16 * v.num_warps),
                    Kernel::BwdDkdv | Kernel::BwdDkdvDq => assert_eq!(v.block_n * v.d_split, 16 * v.num_warps),
                    Kernel::BwdPreprocess | Kernel::BwdDqConvert => {}
                }
            }
        }
    }

    #[test]
    fn small_tiles_fit_99_kib() {
        for d in (8..=256).step_by(8) {
            for dtype in [DType::F16, DType::BF16, DType::F32] {
                for k in [Kernel::Fwd, Kernel::BwdDq, Kernel::BwdDkdv, Kernel::BwdDkdvDq] {
                    let v = variant_for(101376, k, dtype, d, true, 1, 1, 1);
                    assert!(v.smem_bytes() <= 101376, "{} needs {}", v.name(), v.smem_bytes());
                }
            }
        }
    }

    #[test]
    fn even_flags_follow_the_sizes() {
        let v = variant(Kernel::Fwd, DType::BF16, 64, true, 2, 256, 97);
        assert!(v.defines.contains(&("EVEN_M", 1)));
        assert!(v.defines.contains(&("EVEN_N", 0)));
    }
}
