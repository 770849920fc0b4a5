//! The kernel sources (cuda/ at the repository root), embedded at build time, and the expansion
//! of their local `#include "..."` lines so that NVRTC needs no include path.

/// Every file under cuda/ that a kernel includes or is.
pub const FILES: &[(&str, &str)] = &[
    ("types.h", include_str!("../../../../cuda/types.h")),
    ("params.h", include_str!("../../../../cuda/params.h")),
    ("ptx.h", include_str!("../../../../cuda/ptx.h")),
    ("grid_dep.h", include_str!("../../../../cuda/grid_dep.h")),
    ("hopper.h", include_str!("../../../../cuda/hopper.h")),
    ("wgmma.h", include_str!("../../../../cuda/wgmma.h")),
    ("seq.h", include_str!("../../../../cuda/seq.h")),
    ("mask.h", include_str!("../../../../cuda/mask.h")),
    ("block.h", include_str!("../../../../cuda/block.h")),
    ("softmax.h", include_str!("../../../../cuda/softmax.h")),
    ("tile.h", include_str!("../../../../cuda/tile.h")),
    ("tf32.h", include_str!("../../../../cuda/tf32.h")),
    ("tile_f32.h", include_str!("../../../../cuda/tile_f32.h")),
    ("fwd_store.h", include_str!("../../../../cuda/fwd_store.h")),
    ("simt_f32.h", include_str!("../../../../cuda/simt_f32.h")),
    ("sm90_f32.h", include_str!("../../../../cuda/sm90_f32.h")),
    ("fwd_sm90_f32_entry.h", include_str!("../../../../cuda/fwd_sm90_f32_entry.h")),
    ("bwd_dq_sm90_f32_entry.h", include_str!("../../../../cuda/bwd_dq_sm90_f32_entry.h")),
    ("bwd_dkdv_sm90_f32_entry.h", include_str!("../../../../cuda/bwd_dkdv_sm90_f32_entry.h")),
    ("fwd.cu", include_str!("../../../../cuda/fwd.cu")),
    ("fwd_sm90.cu", include_str!("../../../../cuda/fwd_sm90.cu")),
    ("fwd_sm90_f32.cu", include_str!("../../../../cuda/fwd_sm90_f32.cu")),
    ("sm90_f16_parts.h", include_str!("../../../../cuda/sm90_f16_parts.h")),
    ("fwd_sm90_f32_f16.cu", include_str!("../../../../cuda/fwd_sm90_f32_f16.cu")),
    ("bwd_dq_sm90_f32_f16.cu", include_str!("../../../../cuda/bwd_dq_sm90_f32_f16.cu")),
    ("bwd_dkdv_sm90_f32_f16.cu", include_str!("../../../../cuda/bwd_dkdv_sm90_f32_f16.cu")),
    ("fwd_f32.cu", include_str!("../../../../cuda/fwd_f32.cu")),
    ("fwd_f32_simt.cu", include_str!("../../../../cuda/fwd_f32_simt.cu")),
    ("bwd_preprocess.cu", include_str!("../../../../cuda/bwd_preprocess.cu")),
    ("bwd_dq.cu", include_str!("../../../../cuda/bwd_dq.cu")),
    ("bwd_dq_f32.cu", include_str!("../../../../cuda/bwd_dq_f32.cu")),
    ("bwd_dq_f32_simt.cu", include_str!("../../../../cuda/bwd_dq_f32_simt.cu")),
    ("bwd_grads.h", include_str!("../../../../cuda/bwd_grads.h")),
    ("bwd_dkdv.cu", include_str!("../../../../cuda/bwd_dkdv.cu")),
    ("bwd_sm90.cu", include_str!("../../../../cuda/bwd_sm90.cu")),
    ("bwd_dkdv_sm90_f32.cu", include_str!("../../../../cuda/bwd_dkdv_sm90_f32.cu")),
    ("bwd_dq_sm90_f32.cu", include_str!("../../../../cuda/bwd_dq_sm90_f32.cu")),
    ("bwd_dkdv_f32.cu", include_str!("../../../../cuda/bwd_dkdv_f32.cu")),
    ("bwd_dkdv_f32_simt.cu", include_str!("../../../../cuda/bwd_dkdv_f32_simt.cu")),
    ("bwd_dq_convert.cu", include_str!("../../../../cuda/bwd_dq_convert.cu")),
    ("bwd_dsinks.cu", include_str!("../../../../cuda/bwd_dsinks.cu")),
    ("pad.cu", include_str!("../../../../cuda/pad.cu")),
    ("rotary.cu", include_str!("../../../../cuda/rotary.cu")),
    ("warp_reduce.h", include_str!("../../../../cuda/warp_reduce.h")),
    ("decode.h", include_str!("../../../../cuda/decode.h")),
    ("decode_weights.h", include_str!("../../../../cuda/decode_weights.h")),
    ("decode_q4.h", include_str!("../../../../cuda/decode_q4.h")),
    ("decode_q8.h", include_str!("../../../../cuda/decode_q8.h")),
    ("decode.cu", include_str!("../../../../cuda/decode.cu")),
    ("decode_simt.cu", include_str!("../../../../cuda/decode_simt.cu")),
    ("merge.cu", include_str!("../../../../cuda/merge.cu")),
    ("kv_quant.h", include_str!("../../../../cuda/kv_quant.h")),
    ("quantize_kv.cu", include_str!("../../../../cuda/quantize_kv.cu")),
    ("dequantize_kv.cu", include_str!("../../../../cuda/dequantize_kv.cu")),
];

fn file(name: &str) -> Option<&'static str> {
    FILES.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// The translation unit for `name` with each local header inlined once (`#pragma once` dropped).
pub fn expand(name: &str) -> Option<String> {
    let mut seen = Vec::new();
    let mut out = String::new();
    walk(name, &mut seen, &mut out)?;
    Some(out)
}

fn walk(name: &str, seen: &mut Vec<String>, out: &mut String) -> Option<()> {
    for line in file(name)?.lines() {
        let t = line.trim();
        if t == "#pragma once" {
            continue;
        }
        if let Some(rest) = t.strip_prefix("#include") {
            let inc = rest.trim();
            if let Some(h) = inc.strip_prefix('"').and_then(|s| s.strip_suffix('"')) {
                if !seen.iter().any(|s| s == h) {
                    seen.push(h.to_string());
                    walk(h, seen, out)?;
                }
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    Some(())
}

/// FNV-1a, 64 bit: a stable hash (unlike std's) for the on-disk cache key.
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_expands_without_local_includes() {
        for (name, _) in FILES.iter().filter(|(n, _)| n.ends_with(".cu")) {
            let src = expand(name).unwrap();
            assert!(!src.contains("#include \""), "{name} still includes a local header");
            assert!(src.contains("#define FLASH_EXPORT_SMEM"), "{name} lacks types.h");
            // elf.rs reads the one `flash_smem_bytes` each kernel source exports.
            assert_eq!(file(name).unwrap().matches("\nFLASH_EXPORT_SMEM(").count(), 1, "{name}");
        }
    }

    #[test]
    fn every_file_in_cuda_dir_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../cuda");
        for entry in std::fs::read_dir(dir).unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            if name.ends_with(".cu") || name.ends_with(".h") {
                assert!(FILES.iter().any(|(n, _)| *n == name), "cuda/{name} is not in FILES");
            }
        }
    }
}
