// grid_dep.h — programmatic dependent launch (Hopper and later): a kernel launched by device.rs
// `launch_dependent` may start while the stream's previous kernel finishes; it calls
// wait_for_prior_grid() before reading that kernel's results, and the previous kernel may call
// release_dependent_grid() once the rest of its work no longer delays the next one's start. Both
// are no-ops before sm_90 (and for a kernel launched plainly the wait returns at once).
#pragma once

// Blocks until every prior grid this launch depends on has completed and its memory is visible.
__device__ __forceinline__ void wait_for_prior_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the dependent grid be scheduled once every block of this grid has called it (or exited).
__device__ __forceinline__ void release_dependent_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}
