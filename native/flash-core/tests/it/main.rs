//! The integration tests, one module a concern, in one test binary: one link of flash-core instead of
//! one a file (CI: 182 -> 118 s of cargo test on two cores). A test that sets process environment
//! variables keeps a binary of its own (tests/dispatch.rs): these modules' tests run in parallel.
mod common;
mod cuda_head_dims;
mod cuda_masks;
mod decode_cpu;
mod head_dims;
mod masks;
mod materialized;
mod oracle;
mod rotary;
mod strides;
mod validation;
