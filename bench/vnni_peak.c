/*
 * vnni_peak: the most 8-bit multiply-adds one core of this CPU does a second with AVX-512
 * VNNI's vpdpbusd on 256-bit registers (what the GGUF column kernels run,
 * crates/fused-cpu/src/quant/columns_x86.rs) and on 512-bit ones: twelve independent sums held
 * in registers, each instruction four unsigned bytes by four signed ones into 8 (or 16) 32-bit
 * lanes, nothing else in the loop. Also AVX2's vpmaddubsw (pairs of bytes into 16-bit lanes,
 * what the AVX2 kernels run before widening), for a CPU class without VNNI.
 *
 * Why: a product of the quantised decoder cannot run faster than this, so it tells how much of
 * a batch's time a faster kernel could still win (docs/benchmarks.md, "How far batch 32 on the
 * Qwen shape can go"). The loops are written in assembly so that the compiler can neither merge
 * the sums nor keep them in memory: an earlier version held them in an array, which GCC kept on
 * the stack, and timed a load and a store beside each instruction (0.28 ns where the instruction
 * alone takes 0.14 on the Zen 4 of 2026-11-29: two a cycle, not one). The last figure is a
 * vpdpbusd's time beside as many simple integer operations: what a kernel that unpacks its
 * weights can reach at best. The two q8 figures are AVX2's two ways to multiply Q8_0's bytes by
 * one activation row (a row and 32 weights each): signed (a sign, a product and a widening) and
 * by nibbles (two products). The last AVX2 figure is a vpmaddubsw's time beside as many f32 FMAs:
 * where they share pipes (a Zen 4), what each block's scaling costs the products.
 *
 * Build and run: cc -O2 -o vnni_peak vnni_peak.c && ./vnni_peak
 *   (a CPU without AVX-512 VNNI stops with SIGILL after the AVX2 line)
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#define ROUNDS 50000000L

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void cpu_model(char *out, size_t n) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    snprintf(out, n, "unknown");
    while (f && fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) == 0 && colon) {
            snprintf(out, n, "%s", colon + 2);
            out[strcspn(out, "\n")] = 0;
            break;
        }
    }
    if (f) fclose(f);
}

/* Twelve independent instructions `op` on registers `r`0-11 from `r`14 and `r`15. */
#define TWELVE(op, r)                                                                          \
    op " %%" r "14, %%" r "15, %%" r "0\n\t" op " %%" r "14, %%" r "15, %%" r "1\n\t"          \
    op " %%" r "14, %%" r "15, %%" r "2\n\t" op " %%" r "14, %%" r "15, %%" r "3\n\t"          \
    op " %%" r "14, %%" r "15, %%" r "4\n\t" op " %%" r "14, %%" r "15, %%" r "5\n\t"          \
    op " %%" r "14, %%" r "15, %%" r "6\n\t" op " %%" r "14, %%" r "15, %%" r "7\n\t"          \
    op " %%" r "14, %%" r "15, %%" r "8\n\t" op " %%" r "14, %%" r "15, %%" r "9\n\t"          \
    op " %%" r "14, %%" r "15, %%" r "10\n\t" op " %%" r "14, %%" r "15, %%" r "11\n\t"
#define CLOBBERS                                                                               \
    "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",    \
        "xmm11"

/* Seconds per instruction of each loop. */
static double maddubsw(void) {
    double t = seconds();
    for (long k = 0; k < ROUNDS; k++)
        __asm__ volatile(TWELVE("vpmaddubsw", "ymm")::: CLOBBERS);
    return (seconds() - t) / (ROUNDS * 12.0);
}

static double dpbusd_ymm(void) {
    double t = seconds();
    for (long k = 0; k < ROUNDS; k++)
        __asm__ volatile(TWELVE("vpdpbusd", "ymm")::: CLOBBERS);
    return (seconds() - t) / (ROUNDS * 12.0);
}

static double dpbusd_zmm(void) {
    double t = seconds();
    for (long k = 0; k < ROUNDS; k++)
        __asm__ volatile(TWELVE("vpdpbusd", "zmm")::: CLOBBERS);
    return (seconds() - t) / (ROUNDS * 12.0);
}

/* Six vpdpbusd and six one-cycle integer operations (and, or, add, shift: what unpacking a
 * block's values takes) interleaved, independent: seconds per vpdpbusd. Where they share the
 * vector units, the products slow by the others' count. */
static double dpbusd_mixed(void) {
    double t = seconds();
    for (long k = 0; k < ROUNDS; k++)
        __asm__ volatile(
            "vpdpbusd %%ymm14, %%ymm15, %%ymm0\n\tvpand %%ymm14, %%ymm15, %%ymm6\n\t"
            "vpdpbusd %%ymm14, %%ymm15, %%ymm1\n\tvpor %%ymm14, %%ymm15, %%ymm7\n\t"
            "vpdpbusd %%ymm14, %%ymm15, %%ymm2\n\tvpaddd %%ymm14, %%ymm15, %%ymm8\n\t"
            "vpdpbusd %%ymm14, %%ymm15, %%ymm3\n\tvpsrlw $4, %%ymm14, %%ymm9\n\t"
            "vpdpbusd %%ymm14, %%ymm15, %%ymm4\n\tvpand %%ymm14, %%ymm15, %%ymm10\n\t"
            "vpdpbusd %%ymm14, %%ymm15, %%ymm5\n\tvpor %%ymm14, %%ymm15, %%ymm11\n\t"::
                : CLOBBERS);
    return (seconds() - t) / (ROUNDS * 6.0);
}

/* AVX2's Q8_0 product of one activation row by 32 weights, as the register kernel takes it
 * (columns_x86.rs `sums_q8`): vpsignb puts the weights' signs on the activations, vpmaddubsw
 * multiplies the weights' magnitudes by them, vpmaddwd widens the pairs, vpaddd adds them to the
 * row's sums. Four rows, independent: seconds per row. */
static double q8_signed_row(void) {
    double t = seconds();
    for (long k = 0; k < ROUNDS; k++)
        __asm__ volatile(
            "vpsignb %%ymm12, %%ymm13, %%ymm4\n\tvpmaddubsw %%ymm4, %%ymm14, %%ymm4\n\t"
            "vpmaddwd %%ymm4, %%ymm15, %%ymm4\n\tvpaddd %%ymm4, %%ymm0, %%ymm0\n\t"
            "vpsignb %%ymm12, %%ymm13, %%ymm5\n\tvpmaddubsw %%ymm5, %%ymm14, %%ymm5\n\t"
            "vpmaddwd %%ymm5, %%ymm15, %%ymm5\n\tvpaddd %%ymm5, %%ymm1, %%ymm1\n\t"
            "vpsignb %%ymm12, %%ymm13, %%ymm6\n\tvpmaddubsw %%ymm6, %%ymm14, %%ymm6\n\t"
            "vpmaddwd %%ymm6, %%ymm15, %%ymm6\n\tvpaddd %%ymm6, %%ymm2, %%ymm2\n\t"
            "vpsignb %%ymm12, %%ymm13, %%ymm7\n\tvpmaddubsw %%ymm7, %%ymm14, %%ymm7\n\t"
            "vpmaddwd %%ymm7, %%ymm15, %%ymm7\n\tvpaddd %%ymm7, %%ymm3, %%ymm3\n\t"::
                : CLOBBERS);
    return (seconds() - t) / (ROUNDS * 4.0);
}

/* The same 32 weights split into nibbles, as the many-rows kernel takes them
 * (columns_avx2_pair.rs `body_q8`): a vpmaddubsw and a 16-bit vpaddw per nibble, the pairs
 * widened per four or eight runs (not timed). Four rows, independent: seconds per row. */
static double q8_nibble_row(void) {
    double t = seconds();
    for (long k = 0; k < ROUNDS; k++)
        __asm__ volatile(
            "vpmaddubsw %%ymm13, %%ymm14, %%ymm8\n\tvpaddw %%ymm8, %%ymm0, %%ymm0\n\t"
            "vpmaddubsw %%ymm13, %%ymm15, %%ymm9\n\tvpaddw %%ymm9, %%ymm4, %%ymm4\n\t"
            "vpmaddubsw %%ymm12, %%ymm14, %%ymm10\n\tvpaddw %%ymm10, %%ymm1, %%ymm1\n\t"
            "vpmaddubsw %%ymm12, %%ymm15, %%ymm11\n\tvpaddw %%ymm11, %%ymm5, %%ymm5\n\t"
            "vpmaddubsw %%ymm13, %%ymm14, %%ymm8\n\tvpaddw %%ymm8, %%ymm2, %%ymm2\n\t"
            "vpmaddubsw %%ymm13, %%ymm15, %%ymm9\n\tvpaddw %%ymm9, %%ymm6, %%ymm6\n\t"
            "vpmaddubsw %%ymm12, %%ymm14, %%ymm10\n\tvpaddw %%ymm10, %%ymm3, %%ymm3\n\t"
            "vpmaddubsw %%ymm12, %%ymm15, %%ymm11\n\tvpaddw %%ymm11, %%ymm7, %%ymm7\n\t"::
                : CLOBBERS);
    return (seconds() - t) / (ROUNDS * 4.0);
}

/* Six vpmaddubsw and six f32 FMAs interleaved, independent: seconds per vpmaddubsw. On a Zen 4
 * both run on the same two pipes (each alone two a cycle), so this is twice `maddubsw`: a
 * kernel's per-block f32 scaling takes turns with its byte products. */
static double maddubsw_beside_fma(void) {
    double t = seconds();
    for (long k = 0; k < ROUNDS; k++)
        __asm__ volatile(
            "vpmaddubsw %%ymm14, %%ymm15, %%ymm0\n\tvfmadd231ps %%ymm14, %%ymm15, %%ymm6\n\t"
            "vpmaddubsw %%ymm14, %%ymm15, %%ymm1\n\tvfmadd231ps %%ymm14, %%ymm15, %%ymm7\n\t"
            "vpmaddubsw %%ymm14, %%ymm15, %%ymm2\n\tvfmadd231ps %%ymm14, %%ymm15, %%ymm8\n\t"
            "vpmaddubsw %%ymm14, %%ymm15, %%ymm3\n\tvfmadd231ps %%ymm14, %%ymm15, %%ymm9\n\t"
            "vpmaddubsw %%ymm14, %%ymm15, %%ymm4\n\tvfmadd231ps %%ymm14, %%ymm15, %%ymm10\n\t"
            "vpmaddubsw %%ymm14, %%ymm15, %%ymm5\n\tvfmadd231ps %%ymm14, %%ymm15, %%ymm11\n\t"::
                : CLOBBERS);
    return (seconds() - t) / (ROUNDS * 6.0);
}

int main(void) {
    char model[256];
    cpu_model(model, sizeof model);
    /* vpmaddubsw: 32 byte products a 256-bit instruction (their pairs added in 16 bits). */
    double avx2 = maddubsw();
    printf("{\"cpu\": \"%s\", \"maddubsw_ymm_ns\": %.3f, \"maddubsw_gmacs\": %.1f", model,
           avx2 * 1e9, 32 / avx2 / 1e9);
    double signed_row = q8_signed_row(), nibble_row = q8_nibble_row();
    printf(", \"q8_signed_row_ns\": %.3f, \"q8_nibble_row_ns\": %.3f", signed_row * 1e9,
           nibble_row * 1e9);
    printf(", \"maddubsw_beside_fma_ns\": %.3f", maddubsw_beside_fma() * 1e9);
    fflush(stdout);
    double ymm = dpbusd_ymm(), zmm = dpbusd_zmm(), mixed = dpbusd_mixed();
    printf(", \"ymm_ns\": %.3f, \"ymm_gmacs\": %.1f, \"zmm_ns\": %.3f, \"zmm_gmacs\": %.1f, "
           "\"ymm_ns_beside_as_many_integer_ops\": %.3f}\n",
           ymm * 1e9, 32 / ymm / 1e9, zmm * 1e9, 64 / zmm / 1e9, mixed * 1e9);
    return 0;
}
