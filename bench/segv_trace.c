/* A SIGSEGV/SIGABRT handler that prints the native call stack (preloaded where gdb is missing):
 *   cc -shared -fPIC -O0 -o /tmp/segv_trace.so bench/segv_trace.c && LD_PRELOAD=/tmp/segv_trace.so python ...
 * Each frame prints as object(symbol+offset) [address] plus, for addr2line, "@ object +offset" with
 * the offset inside its shared object. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void on_fault(int sig, siginfo_t* info, void* ctx) {
  (void)ctx;
  void* frames[64];
  int n = backtrace(frames, 64);
  fprintf(stderr, "\n=== native stack (signal %d, address %p) ===\n", sig, info ? info->si_addr : NULL);
  fflush(stderr);
  backtrace_symbols_fd(frames, n, 2);
  for (int i = 0; i < n; ++i) {
    Dl_info d;
    if (dladdr(frames[i], &d) && d.dli_fname)
      fprintf(stderr, "@ %s +0x%lx\n", d.dli_fname, (unsigned long)((char*)frames[i] - (char*)d.dli_fbase));
  }
  fflush(stderr);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  // an alternate stack, so that a stack overflow (runaway recursion) still prints
  stack_t alt;
  alt.ss_size = 1 << 20;
  alt.ss_sp = malloc(alt.ss_size);
  alt.ss_flags = 0;
  if (alt.ss_sp) sigaltstack(&alt, NULL);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_RESETHAND | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  sigaction(SIGABRT, &sa, NULL);
}
