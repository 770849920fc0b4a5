//! The integration tests, one module a concern, in one test binary: one link of flash-core instead of
//! one a file (CI: 182 -> 118 s of cargo test on two cores).
mod common;
mod cuda_head_dims;
mod cuda_masks;
mod decode_cpu;
mod dispatch;
mod head_dims;
mod masks;
mod materialized;
mod oracle;
mod rotary;
mod strides;
mod validation;
