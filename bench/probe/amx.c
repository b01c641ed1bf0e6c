/* Does this machine run AMX tile instructions? CPUID can report AMX while the OS (or the
 * hypervisor) has not enabled tile state; then the first tile instruction faults. Exit
 * status: 0 usable, 2 the OS refuses tile data, 3 a tile instruction faulted, 4 a wrong result.
 * Used by bench/llamacpp-compare to build llama.cpp without AMX where it would crash. */
#include <immintrin.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static sigjmp_buf env;
static void on_fault(int sig) { (void)sig; siglongjmp(env, 1); }

struct tile_config {
    unsigned char palette_id, start_row, reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
} __attribute__((aligned(64)));

int main(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        puts("amx: the OS refuses tile state");
        return 2;
    }
    signal(SIGSEGV, on_fault);
    signal(SIGILL, on_fault);
    if (sigsetjmp(env, 1)) {
        puts("amx: a tile instruction faulted");
        return 3;
    }
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    /* C (tile 0, int32) += A (tile 1) · B (tile 2), 16 × 64 bytes each: the int8 product
     * llama.cpp's AMX backend runs; then check one element. */
    static signed char a[16 * 64] __attribute__((aligned(64))), b[16 * 64] __attribute__((aligned(64)));
    static int c[16 * 16] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 64; i++) { a[i] = 1; b[i] = 2; }
    cfg.palette_id = 1;
    for (int t = 0; t < 3; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
    if (c[0] != 128) {
        printf("amx: wrong result %d\n", c[0]);
        return 4;
    }
    puts("amx: usable");
    return 0;
}
