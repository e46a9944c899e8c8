/*
 * The raw floor of int3 tracing: the least a ptrace tracer can do per probe hit.
 * It starts CMD, raises the given semaphores, writes int3 over the given nop sites,
 * and then per hit does only waitpid, PTRACE_GETREGS and PTRACE_CONT: no decoding,
 * no memory reads, no recording. pyprobe's cost per hit is measured against this.
 *
 *   floor [--site ADDR[:REG,...]]... [--sem ADDR]... [--tracer-cpu N] [--target-cpu N]
 *         [--follow 1] [--reads 1] -- CMD ARGS...
 *
 * Addresses are runtime addresses (the benchmark uses a fixed-address python).
 * --tracer-cpu and --target-cpu pin the tracer and the traced command to a CPU each:
 * the same one gives the same-CPU floor (each hit a context switch on one CPU), two
 * different ones the cross-CPU floor (each hit a wake-up on the other CPU).
 * --follow 1 moves the (unpinned) tracer to the CPU the target stopped on at each
 * hit (read from /proc/PID/stat), the way pyprobe follows its target.
 * --reads 1 adds what a tracer that trusts nothing must do beyond that per hit:
 * PTRACE_GETSIGINFO (an int3 reports SI_KERNEL; a kill() of SIGTRAP landing just
 * after a site does not) and one process_vm_readv of the site's string arguments,
 * 192 bytes at each address held by a register named after the site's address
 * (`--site 0x42daa2:r13,r14`). It decodes nothing else and records nothing.
 * Prints "hits N" on stderr at the end and exits with CMD's status.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/user.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <stddef.h>
#include <unistd.h>

#define MAX_ADDRS 64
#define MAX_STRINGS 4
#define FIRST_READ 192
#define SI_KERNEL_CODE 0x80

/* The 64-bit registers a string argument may be held in, by name. */
static const struct { const char *name; size_t offset; } REGS[] = {
    {"rax", offsetof(struct user_regs_struct, rax)}, {"rbx", offsetof(struct user_regs_struct, rbx)},
    {"rcx", offsetof(struct user_regs_struct, rcx)}, {"rdx", offsetof(struct user_regs_struct, rdx)},
    {"rsi", offsetof(struct user_regs_struct, rsi)}, {"rdi", offsetof(struct user_regs_struct, rdi)},
    {"rbp", offsetof(struct user_regs_struct, rbp)}, {"rsp", offsetof(struct user_regs_struct, rsp)},
    {"r8", offsetof(struct user_regs_struct, r8)},   {"r9", offsetof(struct user_regs_struct, r9)},
    {"r10", offsetof(struct user_regs_struct, r10)}, {"r11", offsetof(struct user_regs_struct, r11)},
    {"r12", offsetof(struct user_regs_struct, r12)}, {"r13", offsetof(struct user_regs_struct, r13)},
    {"r14", offsetof(struct user_regs_struct, r14)}, {"r15", offsetof(struct user_regs_struct, r15)},
};

/* A site's string registers ("r13,r14"), as offsets into user_regs_struct. */
static int parse_regs(const char *list, size_t *offsets) {
    int n = 0;
    char buf[128];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        size_t k = 0;
        while (k < sizeof REGS / sizeof REGS[0] && strcmp(REGS[k].name, tok) != 0) k++;
        if (k == sizeof REGS / sizeof REGS[0] || n == MAX_STRINGS) return -1;
        offsets[n++] = REGS[k].offset;
    }
    return n;
}

static void pin(pid_t who, int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(who, sizeof set, &set) != 0) perror("floor: sched_setaffinity");
}

/* Field 39 of /proc/PID/stat: the CPU the process last ran on. */
static int last_cpu(pid_t pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return -1;
    /* After ") ": field 3 (state) onwards; field 39 is 36 fields further. */
    int field = 2;
    for (p++; *p && field < 39; p++)
        if (*p == ' ') field++;
    return field == 39 ? atoi(p) : -1;
}

int main(int argc, char **argv) {
    uint64_t sites[MAX_ADDRS], sems[MAX_ADDRS];
    size_t strings[MAX_ADDRS][MAX_STRINGS];
    int nstrings[MAX_ADDRS] = {0};
    int nsites = 0, nsems = 0, i = 1, tracer_cpu = -1, target_cpu = -1, follow = 0, reads = 0;

    for (; i < argc && strcmp(argv[i], "--") != 0; i += 2) {
        if (i + 1 >= argc) { fprintf(stderr, "floor: %s needs an address\n", argv[i]); return 2; }
        uint64_t a = strtoull(argv[i + 1], NULL, 0);
        if (!strcmp(argv[i], "--site") && nsites < MAX_ADDRS) {
            const char *colon = strchr(argv[i + 1], ':');
            if (colon && (nstrings[nsites] = parse_regs(colon + 1, strings[nsites])) < 0) {
                fprintf(stderr, "floor: bad registers in %s\n", argv[i + 1]);
                return 2;
            }
            sites[nsites++] = a;
        }
        else if (!strcmp(argv[i], "--sem") && nsems < MAX_ADDRS) sems[nsems++] = a;
        else if (!strcmp(argv[i], "--tracer-cpu")) tracer_cpu = (int)a;
        else if (!strcmp(argv[i], "--target-cpu")) target_cpu = (int)a;
        else if (!strcmp(argv[i], "--follow")) follow = (int)a;
        else if (!strcmp(argv[i], "--reads")) reads = (int)a;

        else { fprintf(stderr, "floor: unknown option %s\n", argv[i]); return 2; }
    }
    if (i + 1 >= argc) { fprintf(stderr, "usage: floor [--site A]... [--sem A]... -- CMD...\n"); return 2; }
    char **cmd = argv + i + 1;

    pid_t pid = fork();
    if (pid == 0) {
        if (target_cpu >= 0) pin(0, target_cpu);
        ptrace(PTRACE_TRACEME, 0, 0, 0);
        execvp(cmd[0], cmd);
        _exit(127);
    }
    if (tracer_cpu >= 0) pin(0, tracer_cpu);
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
            if (reads) {
                siginfo_t info;
                if (ptrace(PTRACE_GETSIGINFO, pid, 0, &info) == 0 && info.si_code != SI_KERNEL_CODE)
                    sig = SIGTRAP; /* not ours: delivered */
                int k = 0;
                while (k < nsites && sites[k] != regs.rip - 1) k++;
                if (k < nsites && nstrings[k] > 0) {
                    static char text[MAX_STRINGS][FIRST_READ];
                    struct iovec local[MAX_STRINGS], remote[MAX_STRINGS];
                    for (int j = 0; j < nstrings[k]; j++) {
                        local[j] = (struct iovec){text[j], FIRST_READ};
                        remote[j] = (struct iovec){(void *)*(uint64_t *)((char *)&regs + strings[k][j]), FIRST_READ};
                    }
                    process_vm_readv(pid, local, nstrings[k], remote, nstrings[k], 0);
                }
            }
            if (follow) {
                int cpu = last_cpu(pid);
                if (cpu >= 0 && cpu != sched_getcpu()) pin(0, cpu);
            }
        }
        ptrace(PTRACE_CONT, pid, 0, sig);
    }
    fprintf(stderr, "hits %lu\n", hits);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}
