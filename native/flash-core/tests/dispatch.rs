//! The dispatch rules (`flash_core::dispatch::choose`): mode, environment overrides, the ceiling
//! and the crossover table. One test function: it sets process environment variables, which no
//! other test of this binary may read meanwhile (so it keeps a binary of its own, outside tests/it).

#[path = "it/common/mod.rs"]
mod common;

use common::*;
use flash_core::dispatch::{self, Backend, Pass, Path, MAX_BYTES_ENV, MODE_ENV};
use flash_core::{DType, FlashError, Mode};

fn problem(b: usize, s: usize, hkv: usize, mode: Mode) -> flash_core::Problem {
    let mut p = case(dims(b, s, s, 2 * hkv, hkv, 16), DType::F32, true, 1).p;
    p.mode = mode;
    p
}

fn choose(p: &flash_core::Problem, pass: Pass) -> Result<Path, FlashError> {
    dispatch::choose(p, Backend::Cpu, pass)
}

#[test]
fn dispatch_rules() {
    std::env::remove_var(MODE_ENV);
    std::env::remove_var(MAX_BYTES_ENV);
    let threads = rayon::current_num_threads();

    // Explicit modes.
    let small = |mode| problem(4 * threads, 16, 2, mode);
    for pass in [Pass::Forward, Pass::Backward] {
        assert_eq!(choose(&small(Mode::Fused), pass), Ok(Path::Fused));
        assert_eq!(choose(&small(Mode::Materialized), pass), Ok(Path::Materialized));
        // CUDA has no materialized kernels: auto is fused there, an explicit request an error.
        assert_eq!(dispatch::choose(&small(Mode::Auto), Backend::Cuda, pass), Ok(Path::Fused));
        assert!(matches!(dispatch::choose(&small(Mode::Materialized), Backend::Cuda, pass), Err(FlashError::Unsupported(_))));
    }

    // Auto follows the table: every row's boundary, on both sides.
    for row in dispatch::CPU_CROSSOVER {
        let (b, hkv) = (row.min_pairs, 1);
        assert_eq!(choose(&problem(b, row.max_seq, hkv, Mode::Auto), row.pass), Ok(Path::Materialized), "{row:?} at its bounds");
        let longest = dispatch::CPU_CROSSOVER.iter().filter(|r| r.pass == row.pass).map(|r| r.max_seq).max().unwrap();
        assert_eq!(choose(&problem(b, longest + 1, hkv, Mode::Auto), row.pass), Ok(Path::Fused), "{row:?} past every row");
    }
    // Fewer pairs than every row asks: fused.
    let fewest = dispatch::CPU_CROSSOVER.iter().map(|r| r.min_pairs).min().unwrap_or(1);
    if fewest > 1 {
        assert_eq!(choose(&problem(fewest - 1, 8, 1, Mode::Auto), Pass::Forward), Ok(Path::Fused));
    }
    let p = problem(1, 8, 1, Mode::Auto);
    let want = dispatch::table_prefers_materialized(&p, Backend::Cpu, Pass::Forward);
    assert_eq!(choose(&p, Pass::Forward), Ok(if want { Path::Materialized } else { Path::Fused }));

    // The ceiling: exactly the working set fits; a byte less refuses an explicit request and makes
    // auto fused.
    let p = small(Mode::Materialized);
    for pass in [Pass::Forward, Pass::Backward] {
        let need = dispatch::working_set(&p, Backend::Cpu, pass);
        let ld = 16usize.div_ceil(16) * 16 + 16;
        let per_task = 16 * ld * 4 * if pass == Pass::Backward { 2 } else { 1 };
        assert_eq!(need, (threads.min(p.dims.batch * p.dims.kv_heads) * per_task) as u128);
        std::env::set_var(MAX_BYTES_ENV, need.to_string());
        assert_eq!(choose(&p, pass), Ok(Path::Materialized));
        std::env::set_var(MAX_BYTES_ENV, (need - 1).to_string());
        let err = choose(&p, pass).unwrap_err();
        assert!(matches!(&err, FlashError::Unsupported(m) if m.contains("ceiling") && m.contains(MAX_BYTES_ENV)), "{err}");
        let mut auto = p.clone();
        auto.mode = Mode::Auto;
        assert_eq!(choose(&auto, pass), Ok(Path::Fused));
    }
    std::env::set_var(MAX_BYTES_ENV, "lots");
    assert!(matches!(choose(&p, Pass::Forward), Err(FlashError::Unsupported(m)) if m.contains(MAX_BYTES_ENV)));
    std::env::remove_var(MAX_BYTES_ENV);

    // The environment's mode overrides the call's.
    std::env::set_var(MODE_ENV, "fused");
    assert_eq!(choose(&small(Mode::Materialized), Pass::Forward), Ok(Path::Fused));
    std::env::set_var(MODE_ENV, "materialized");
    assert_eq!(choose(&small(Mode::Fused), Pass::Backward), Ok(Path::Materialized));
    std::env::set_var(MODE_ENV, " ");
    assert_eq!(choose(&small(Mode::Fused), Pass::Backward), Ok(Path::Fused));
    std::env::set_var(MODE_ENV, "quick");
    assert!(matches!(choose(&small(Mode::Fused), Pass::Forward), Err(FlashError::Unsupported(m)) if m.contains(MODE_ENV)));
    std::env::remove_var(MODE_ENV);

    assert_eq!(Mode::parse("materialized"), Ok(Mode::Materialized));
    assert!(Mode::parse("Fused").is_err());
}
