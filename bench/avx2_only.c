/*
 * avx2_only.so: run a peer (ONNX Runtime, PyTorch) as it runs on a CPU with AVX2 but no
 * AVX-512, AVX-VNNI or AMX (AMD's Zen 2 and 3, GCP's N2D and T2D), on a machine that has them.
 *
 * Why: spotinfer can be told to run its AVX2 kernels (--cpu-kernels avx2), but ONNX Runtime
 * has no such setting (its MLAS picks kernels from CPUID, build options aside), so on this
 * project's machines an "AVX2 kernels against ONNX Runtime" figure would pit AVX2 against
 * AVX-512. This library makes the comparison fair: loaded with LD_PRELOAD, it turns on Linux's
 * CPUID faulting (arch_prctl ARCH_SET_CPUID, on CPUs whose /proc/cpuinfo lists cpuid_fault),
 * so every CPUID instruction the process runs afterwards traps; the handler runs the real
 * CPUID and clears the AVX-512, AVX-VNNI and AMX bits before handing the answer back. The
 * setting is inherited by threads and children and reset by execve, and the library is
 * preloaded again there.
 *
 * What it cannot hide: CPUID run before the library's constructor (the dynamic loader's and
 * glibc's own, which only choose memcpy and friends) and XGETBV, which does not trap; every
 * library that picks kernels checks the CPUID bits as well, so clearing them is enough.
 * bench/compare.py checks that it took: PyTorch under it must report "AVX2".
 *
 * Build: cc -O2 -shared -fPIC -o avx2_only.so avx2_only.c
 * AVX2_ONLY_REPORT=1 prints how many CPUID calls were answered, at exit.
 */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

/* CPUID leaf 7, subleaf 0. */
#define EBX_AVX512 ((1u << 16) | (1u << 17) | (1u << 21) | (1u << 26) | (1u << 27) | \
                    (1u << 28) | (1u << 30) | (1u << 31))           /* F DQ IFMA PF ER CD BW VL */
#define ECX_AVX512 ((1u << 1) | (1u << 6) | (1u << 11) | (1u << 12) | (1u << 14))
                                                 /* VBMI VBMI2 VNNI BITALG VPOPCNTDQ */
#define EDX_AVX512_AMX ((1u << 2) | (1u << 3) | (1u << 8) | (1u << 22) | (1u << 23) | \
                        (1u << 24) | (1u << 25)) /* 4VNNIW 4FMAPS VP2INTERSECT AMX-BF16 FP16
                                                    AMX-TILE AMX-INT8 */
/* CPUID leaf 7, subleaf 1. */
#define EAX1_VNNI_BF16 ((1u << 4) | (1u << 5))  /* AVX-VNNI, AVX512_BF16 */

static volatile long answered;

static long cpuid_faulting(int off) {
    /* ARCH_SET_CPUID's argument is "CPUID allowed": 0 makes it trap. */
    return syscall(SYS_arch_prctl, ARCH_SET_CPUID, off ? 0 : 1);
}

static void on_segv(int sig, siginfo_t *info, void *context) {
    ucontext_t *uc = context;
    greg_t *reg = uc->uc_mcontext.gregs;
    const uint8_t *ip = (const uint8_t *)reg[REG_RIP];
    (void)info;
    if (ip[0] != 0x0f || ip[1] != 0xa2) {
        /* A real fault: die of it as the process would have without this library. */
        signal(sig, SIG_DFL);
        return;
    }
    uint32_t leaf = (uint32_t)reg[REG_RAX], sub = (uint32_t)reg[REG_RCX];
    uint32_t a, b, c, d;
    cpuid_faulting(0);
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(leaf), "c"(sub));
    cpuid_faulting(1);
    if (leaf == 7 && sub == 0) {
        b &= ~EBX_AVX512;
        c &= ~ECX_AVX512;
        d &= ~EDX_AVX512_AMX;
    } else if (leaf == 7 && sub == 1) {
        a &= ~EAX1_VNNI_BF16;
    }
    reg[REG_RAX] = a;
    reg[REG_RBX] = b;
    reg[REG_RCX] = c;
    reg[REG_RDX] = d;
    reg[REG_RIP] += 2;
    answered++;
}

static void report(void) {
    fprintf(stderr, "avx2_only: answered %ld CPUID calls with AVX-512, AVX-VNNI and AMX hidden\n",
            answered);
}

__attribute__((constructor)) static void hide_avx512(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGSEGV, &sa, NULL) != 0 || cpuid_faulting(1) != 0) {
        fprintf(stderr, "avx2_only: this CPU or kernel has no CPUID faulting (cpuid_fault in "
                        "/proc/cpuinfo); cannot hide AVX-512\n");
        _exit(3);
    }
    if (getenv("AVX2_ONLY_REPORT"))
        atexit(report);
}
