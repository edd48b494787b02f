//! How the process holds memory: large buffers freed go back to the system at once, and a
//! generation model's threads share one arena.

/// Makes glibc give a freed buffer of over 1 MiB back to the system. By default it raises its
/// mmap threshold to the size of each large block freed (up to 32 MiB), after which large
/// buffers, once freed, stay resident in each thread's arena: four image-decoding threads held
/// 40 MiB more than their budget that way (`tests/images.rs`), and a publish of 2 MB Parquet
/// rows peaked at 534 MiB instead of 280 MiB (docs/benchmarks.md, "Publish"). A fixed threshold
/// stops that. Set once; a no-op elsewhere than glibc.
pub fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        // SAFETY: mallopt only sets an allocator parameter; it is called once, before the
        // large buffers it is for are allocated.
        ONCE.call_once(|| unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        });
    }
}

/// Makes glibc serve every thread from its one main arena instead of one arena per thread (up
/// to eight a core), for a process that generates on the CPU decoder: its steps allocate and
/// free on the model's thread and the kernels' threads alike, and each arena kept its own free
/// pieces. Measured on a 2-vCPU Zen 4, the CPU decoder at 32 sequences, 64 new tokens, 5 and 3
/// alternated runs: a Qwen2.5-0.5B-shape Q4_K_M peaked at 567–568 MiB instead of 592–626,
/// SmolLM2-135M Q4_1 at 323–324 instead of 342–347, tokens/s the same within the VM's noise.
/// Threads that already have an arena keep it. Set once; a no-op elsewhere than glibc.
pub fn one_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        // SAFETY: mallopt only sets an allocator parameter.
        ONCE.call_once(|| unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        });
    }
}
