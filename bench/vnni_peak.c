/*
 * vnni_peak: the most 8-bit multiply-adds one core of this CPU does a second with AVX-512
 * VNNI's vpdpbusd on 256-bit registers (what the GGUF column kernels run,
 * crates/fused-cpu/src/quant/columns_x86.rs) and on 512-bit ones: 24 independent sums, each
 * instruction four unsigned bytes by four signed ones into 8 (or 16) 32-bit lanes, nothing else
 * in the loop.
 *
 * Why: a product of the quantised decoder cannot run faster than this, so it tells how much of
 * a batch's time a faster kernel could still win (docs/benchmarks.md, "How far batch 32 on the
 * Qwen shape can go"). On the 2-vCPU Zen 4 of 2026-11-28: 0.28-0.31 ns a 256-bit instruction
 * (about one a cycle: 104-116 billion multiply-adds a second a core), 0.55-0.74 ns a 512-bit one
 * (no more multiply-adds: Zen 4 runs 512-bit operations in two halves).
 *
 * Build and run: cc -O2 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -o vnni_peak vnni_peak.c
 *   && ./vnni_peak   (a CPU without AVX-512 VNNI stops with SIGILL)
 */
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define SUMS 24
#define ROUNDS 10000000L

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

int main(void) {
    __m256i a[SUMS], w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
    __m512i b[SUMS], w5 = _mm512_set1_epi8(3), x5 = _mm512_set1_epi8(5);
    for (int i = 0; i < SUMS; i++) {
        a[i] = _mm256_set1_epi32(i);
        b[i] = _mm512_set1_epi32(i);
    }
    double t = seconds();
    for (long k = 0; k < ROUNDS; k++) {
#pragma GCC unroll 24
        for (int i = 0; i < SUMS; i++) {
            a[i] = _mm256_dpbusd_epi32(a[i], w, x);
            __asm__ volatile("" : "+v"(a[i]));
        }
    }
    double ymm = (seconds() - t) / (ROUNDS * SUMS);
    t = seconds();
    for (long k = 0; k < ROUNDS; k++) {
#pragma GCC unroll 24
        for (int i = 0; i < SUMS; i++) {
            b[i] = _mm512_dpbusd_epi32(b[i], w5, x5);
            __asm__ volatile("" : "+v"(b[i]));
        }
    }
    double zmm = (seconds() - t) / (ROUNDS * SUMS);
    int check = 0;
    for (int i = 0; i < SUMS; i++)
        check += _mm256_extract_epi32(a[i], 0) + _mm_extract_epi32(_mm512_castsi512_si128(b[i]), 0);
    char model[256];
    cpu_model(model, sizeof model);
    printf("{\"cpu\": \"%s\", \"ymm_ns\": %.3f, \"ymm_gmacs\": %.1f, \"zmm_ns\": %.3f, "
           "\"zmm_gmacs\": %.1f, \"check\": %d}\n",
           model, ymm * 1e9, 32 / ymm / 1e9, zmm * 1e9, 64 / zmm / 1e9, check);
    return 0;
}
