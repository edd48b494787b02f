//! How the process gives memory back: large buffers freed go back to the system at once.

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
