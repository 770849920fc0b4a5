//! How f32 products are computed: the caller's `precision` option (Python and Elixir).
//!
//! * `exact` (default): f32 accuracy. On the GPU the forward and backward run on tensor cores as
//!   split-TF32 products (three TF32 products per pair, summed in f32; cuda/tf32.h) where those
//!   kernels meet the f32 bound (cuda/config.rs's `tf32_terms`), SIMT f32 FMAs elsewhere; the CPU
//!   always computes in f32.
//! * `tf32`: one TF32 product per pair on the GPU (q, k, v, dO, the probabilities and dS rounded to
//!   11 significant bits: relative errors of order 1e-3, see [`TF32_BOUND`]); faster. Asked for by
//!   name only. The CPU stays exact f32; f16 / bf16 inputs are unaffected (their products are
//!   exact in the tensor cores already).

use crate::error::{FlashError, Result};

/// The caller's choice for f32 inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    #[default]
    Exact,
    Tf32,
}

/// The documented worst relative error (||x - oracle|| / ||oracle||, the tests' rel_err) of
/// `precision="tf32"`'s o, lse, dq, dk and dv against the float64 oracle; tests/test_tf32.py checks
/// it on the GPU.
pub const TF32_BOUND: f64 = 5e-3;

impl Precision {
    /// "exact" or "tf32".
    pub fn parse(name: &str) -> Result<Precision> {
        match name {
            "exact" => Ok(Precision::Exact),
            "tf32" => Ok(Precision::Tf32),
            other => Err(FlashError::Unsupported(format!("unknown precision {other:?}; expected \"exact\" or \"tf32\""))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Exact => "exact",
            Precision::Tf32 => "tf32",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_others_are_errors() {
        for p in [Precision::Exact, Precision::Tf32] {
            assert_eq!(Precision::parse(p.name()).unwrap(), p);
        }
        let e = Precision::parse("fast").unwrap_err().to_string();
        assert!(e.contains("\"fast\"") && e.contains("exact") && e.contains("tf32"), "{e}");
        assert_eq!(Precision::default(), Precision::Exact);
    }
}
