/*
 * The raw floor of int3 tracing: the least a ptrace tracer can do per probe hit.
 * It starts CMD, raises the given semaphores, writes int3 over the given nop sites,
 * and then per hit does only waitpid, PTRACE_GETREGS and PTRACE_CONT: no decoding,
 * no memory reads, no recording. pyprobe's cost per hit is measured against this.
 *
 *   floor [--site ADDR]... [--sem ADDR]... -- CMD ARGS...
 *
 * Addresses are runtime addresses (the benchmark uses a fixed-address python).
 * Prints "hits N" on stderr at the end and exits with CMD's status.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_ADDRS 64

int main(int argc, char **argv) {
    uint64_t sites[MAX_ADDRS], sems[MAX_ADDRS];
    int nsites = 0, nsems = 0, i = 1;
    for (; i < argc && strcmp(argv[i], "--") != 0; i += 2) {
        if (i + 1 >= argc) { fprintf(stderr, "floor: %s needs an address\n", argv[i]); return 2; }
        uint64_t a = strtoull(argv[i + 1], NULL, 0);
        if (!strcmp(argv[i], "--site") && nsites < MAX_ADDRS) sites[nsites++] = a;
        else if (!strcmp(argv[i], "--sem") && nsems < MAX_ADDRS) sems[nsems++] = a;
        else { fprintf(stderr, "floor: unknown option %s\n", argv[i]); return 2; }
    }
    if (i + 1 >= argc) { fprintf(stderr, "usage: floor [--site A]... [--sem A]... -- CMD...\n"); return 2; }
    char **cmd = argv + i + 1;

    pid_t pid = fork();
    if (pid == 0) {
        ptrace(PTRACE_TRACEME, 0, 0, 0);
        execvp(cmd[0], cmd);
        _exit(127);
    }
    int st;
    waitpid(pid, &st, 0); /* the SIGTRAP of exec */
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/mem", pid);
    int mem = open(path, O_RDWR);
    if (mem < 0) { perror("floor: open mem"); return 1; }
    for (int k = 0; k < nsems; k++) {
        uint16_t v;
        pread(mem, &v, 2, (off_t)sems[k]);
        v++;
        pwrite(mem, &v, 2, (off_t)sems[k]);
    }
    for (int k = 0; k < nsites; k++) {
        uint8_t b;
        pread(mem, &b, 1, (off_t)sites[k]);
        if (b != 0x90) { fprintf(stderr, "floor: no nop at %#lx\n", (unsigned long)sites[k]); return 1; }
        b = 0xcc;
        pwrite(mem, &b, 1, (off_t)sites[k]);
    }
    ptrace(PTRACE_CONT, pid, 0, 0);
    unsigned long hits = 0;
    struct user_regs_struct regs;
    for (;;) {
        if (waitpid(pid, &st, 0) < 0) { if (errno == EINTR) continue; break; }
        if (WIFEXITED(st) || WIFSIGNALED(st)) break;
        int sig = WSTOPSIG(st);
        if (sig == SIGTRAP) {
            ptrace(PTRACE_GETREGS, pid, 0, &regs);
            hits++;
            sig = 0;
        }
        ptrace(PTRACE_CONT, pid, 0, sig);
    }
    fprintf(stderr, "hits %lu\n", hits);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}
