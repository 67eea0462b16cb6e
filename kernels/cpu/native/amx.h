/* AMX (Intel's tile matrix unit): whether this process may use the tiles, found by trying, never
 * assumed, and the few tile instructions the kernels use (inline assembly: no -mamx flags needed).
 *
 * Linux hands out the tile state only to a process that asks for it (arch_prctl
 * ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); without the request the first tile load is SIGILL, and
 * a machine (a VM) may advertise AMX and fault on it even so. So a forked child asks, runs one int8
 * product and checks it; only if it exits cleanly does the parent ask for itself (the permission is
 * process-wide, so every thread of the pool may then configure tiles). LLMSERVE_AMX=0 turns the
 * tiles off. Shared by quant_int8act.c (TDPBSSD) and small_gemm.c (TDPBF16PS); each library asks
 * once, on first use. */

#ifndef LLMSERVE_AMX_H
#define LLMSERVE_AMX_H

#if defined(__AVX512F__) && defined(__x86_64__) && defined(__linux__)
#define AMX_PATH 1
#include <cpuid.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) amx_config;

#define TILE_LOAD(t, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void *)(base)), "r"((int64_t)(stride)) : "memory")
#define TILE_STORE(t, base, stride) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"((void *)(base)), "r"((int64_t)(stride)) : "memory")
#define TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define TILE_DP(c, a, b) __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#define TILE_DPBF16(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#define TILE_RELEASE() __asm__ volatile("tilerelease" ::)
#define TILE_CONFIGURE(cfg) __asm__ volatile("ldtilecfg %0" ::"m"(cfg))

/* The probe's product: 16 rows x 16 columns x 32 signed bytes (tiles 0, 4, 5), checked entry by entry. */
static int amx_child_check(void) {
    /* LLMSERVE_AMX_PROBE_FAULT=1 (tests): the child faults as on a machine that advertises AMX and
     * does not grant it, to show the parent goes on without the tiles */
    const char *fault = getenv("LLMSERVE_AMX_PROBE_FAULT");
    if (fault && fault[0] == '1') __builtin_trap();
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return 2;
    int8_t a[16 * 32];
    int8_t w[8 * 64];
    int32_t got[16 * 16];
    for (int i = 0; i < 16 * 32; ++i) a[i] = (int8_t)(i * 7 % 255 - 127);
    for (int i = 0; i < 8 * 64; ++i) w[i] = (int8_t)(i * 13 % 256 - 128);
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    c.rows[0] = 16, c.colsb[0] = 64;
    c.rows[4] = 16, c.colsb[4] = 32;
    c.rows[5] = 8, c.colsb[5] = 64;
    TILE_CONFIGURE(c);
    TILE_LOAD(4, a, 32);
    TILE_LOAD(5, w, 64);
    TILE_ZERO(0);
    TILE_DP(0, 4, 5);
    TILE_STORE(0, got, 64);
    TILE_RELEASE();
    for (int r = 0; r < 16; ++r)
        for (int col = 0; col < 16; ++col) {
            int32_t s = 0;
            for (int e = 0; e < 32; ++e) s += a[r * 32 + e] * w[(e / 4) * 64 + col * 4 + e % 4];
            if (s != got[r * 16 + col]) return 3;
        }
    return 0;
}

static int amx_granted(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return 0;
    const char *env = getenv("LLMSERVE_AMX");
    if (env && env[0] == '0') return 0;
    const pid_t pid = fork();
    if (pid == 0) _exit(amx_child_check());
    if (pid < 0) return 0;
    int st = 0;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR) return 0;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* AMX-BF16 (TDPBF16PS): CPUID.(7,0):EDX bit 22, on top of the tiles the probe granted. */
static int amx_bf16_listed(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22));
}

static int amx_ok = -1;  /* the probe's answer: -1 not asked yet */
static int use_amx = 1;  /* tests turn it off */
static int amx_active(void) {
    if (amx_ok < 0) amx_ok = amx_granted();
    return amx_ok && use_amx;
}
#endif

#endif
