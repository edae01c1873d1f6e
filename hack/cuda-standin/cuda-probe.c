/* cuda-probe: what a container can reach through the driver's libraries, loaded by soname as a CUDA program
 * loads them (no LD_LIBRARY_PATH). Prints, one fact a line (cli/podprobe.py parses it):
 *   cuda: driver <version int>
 *   cuda: <n> devices [(<why none>)]
 *   cuda: device <ordinal> <uuid> <MiB> MiB <name>
 *   nvml: driver <version>
 *   nvml: <n> devices [(<why none>)]
 *   nvml: device <index> <uuid> <MiB> MiB <name>
 *   nvml: mig <gpu index> <mig index> <uuid> <MiB> MiB <name>
 *   mps: <CUDA_MPS_* variable>=<value>
 *   alloc: <MiB> MiB on device 0 [(<why not>)]        with --alloc-mib N
 * then sleeps, so a pod stays running, unless given --once. --alloc-mib N creates a context on CUDA device 0
 * and allocates N MiB in it, held while the program runs (what a workload's memory use looks like to NVML). */
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern char **environ;

typedef struct { unsigned char bytes[16]; } CUuuid;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef void *nvmlDevice_t;

#define MiB(bytes) ((unsigned long long)(bytes) >> 20)

/* dlsym of every name in the list, or a line saying which one is missing. */
#define SYM(lib, prefix, var, name) \
  if (!(var = (__typeof__(var))dlsym(lib, name))) { \
    printf("%s: 0 devices (dlsym %s: %s)\n", prefix, name, dlerror()); \
    return; \
  }

static void format_uuid(char *out, size_t n, const char *prefix, const unsigned char b[16]) {
  snprintf(out, n, "%s%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", prefix, b[0], b[1],
           b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static void probe_cuda(void) {
  int (*cuInit)(unsigned);
  int (*cuDriverGetVersion)(int *);
  int (*cuDeviceGetCount)(int *);
  int (*cuDeviceGet)(int *, int);
  int (*cuDeviceGetName)(char *, int, int);
  int (*cuDeviceGetUuid_v2)(CUuuid *, int);
  int (*cuDeviceTotalMem_v2)(size_t *, int);
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) {
    printf("cuda: 0 devices (dlopen libcuda.so.1: %s)\n", dlerror());
    return;
  }
  SYM(lib, "cuda", cuInit, "cuInit")
  SYM(lib, "cuda", cuDriverGetVersion, "cuDriverGetVersion")
  SYM(lib, "cuda", cuDeviceGetCount, "cuDeviceGetCount")
  SYM(lib, "cuda", cuDeviceGet, "cuDeviceGet")
  SYM(lib, "cuda", cuDeviceGetName, "cuDeviceGetName")
  SYM(lib, "cuda", cuDeviceGetUuid_v2, "cuDeviceGetUuid_v2")
  SYM(lib, "cuda", cuDeviceTotalMem_v2, "cuDeviceTotalMem_v2")
  int version = 0, count = 0, r;
  if (cuDriverGetVersion(&version) == 0) printf("cuda: driver %d\n", version);
  if ((r = cuInit(0)) != 0) {
    printf("cuda: 0 devices (cuInit: error %d)\n", r);
    return;
  }
  if ((r = cuDeviceGetCount(&count)) != 0) {
    printf("cuda: 0 devices (cuDeviceGetCount: error %d)\n", r);
    return;
  }
  printf("cuda: %d devices\n", count);
  for (int i = 0; i < count; i++) {
    int dev;
    char name[256] = "", uuid[64] = "";
    CUuuid raw;
    size_t mem = 0;
    if ((r = cuDeviceGet(&dev, i)) != 0 || (r = cuDeviceGetName(name, sizeof name, dev)) != 0 ||
        (r = cuDeviceGetUuid_v2(&raw, dev)) != 0 || (r = cuDeviceTotalMem_v2(&mem, dev)) != 0) {
      printf("cuda: device %d error %d\n", i, r);
      continue;
    }
    /* CUDA gives 16 bytes; nvidia-smi spells a MIG device's UUID with MIG-, its name says MIG. */
    format_uuid(uuid, sizeof uuid, strstr(name, " MIG ") ? "MIG-" : "GPU-", raw.bytes);
    printf("cuda: device %d %s %llu MiB %s\n", i, uuid, MiB(mem), name);
  }
}

static void probe_nvml(void) {
  int (*nvmlInit_v2)(void);
  int (*nvmlShutdown)(void);
  int (*nvmlSystemGetDriverVersion)(char *, unsigned);
  int (*nvmlDeviceGetCount_v2)(unsigned *);
  int (*nvmlDeviceGetHandleByIndex_v2)(unsigned, nvmlDevice_t *);
  int (*nvmlDeviceGetUUID)(nvmlDevice_t, char *, unsigned);
  int (*nvmlDeviceGetName)(nvmlDevice_t, char *, unsigned);
  int (*nvmlDeviceGetMemoryInfo)(nvmlDevice_t, nvmlMemory_t *);
  int (*nvmlDeviceGetMaxMigDeviceCount)(nvmlDevice_t, unsigned *);
  int (*nvmlDeviceGetMigDeviceHandleByIndex)(nvmlDevice_t, unsigned, nvmlDevice_t *);
  void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  if (!lib) {
    printf("nvml: 0 devices (dlopen libnvidia-ml.so.1: %s)\n", dlerror());
    return;
  }
  SYM(lib, "nvml", nvmlInit_v2, "nvmlInit_v2")
  SYM(lib, "nvml", nvmlShutdown, "nvmlShutdown")
  SYM(lib, "nvml", nvmlSystemGetDriverVersion, "nvmlSystemGetDriverVersion")
  SYM(lib, "nvml", nvmlDeviceGetCount_v2, "nvmlDeviceGetCount_v2")
  SYM(lib, "nvml", nvmlDeviceGetHandleByIndex_v2, "nvmlDeviceGetHandleByIndex_v2")
  SYM(lib, "nvml", nvmlDeviceGetUUID, "nvmlDeviceGetUUID")
  SYM(lib, "nvml", nvmlDeviceGetName, "nvmlDeviceGetName")
  SYM(lib, "nvml", nvmlDeviceGetMemoryInfo, "nvmlDeviceGetMemoryInfo")
  SYM(lib, "nvml", nvmlDeviceGetMaxMigDeviceCount, "nvmlDeviceGetMaxMigDeviceCount")
  SYM(lib, "nvml", nvmlDeviceGetMigDeviceHandleByIndex, "nvmlDeviceGetMigDeviceHandleByIndex")
  int r;
  unsigned count = 0;
  char text[256];
  if ((r = nvmlInit_v2()) != 0) {
    printf("nvml: 0 devices (nvmlInit_v2: error %d)\n", r);
    return;
  }
  if (nvmlSystemGetDriverVersion(text, sizeof text) == 0) printf("nvml: driver %s\n", text);
  if ((r = nvmlDeviceGetCount_v2(&count)) != 0) {
    printf("nvml: 0 devices (nvmlDeviceGetCount_v2: error %d)\n", r);
    nvmlShutdown();
    return;
  }
  printf("nvml: %u devices\n", count);
  for (unsigned i = 0; i < count; i++) {
    nvmlDevice_t dev, mig;
    char uuid[96] = "";
    nvmlMemory_t mem = {0};
    unsigned migs = 0;
    if (nvmlDeviceGetHandleByIndex_v2(i, &dev) != 0 || nvmlDeviceGetUUID(dev, uuid, sizeof uuid) != 0 ||
        nvmlDeviceGetName(dev, text, sizeof text) != 0 || nvmlDeviceGetMemoryInfo(dev, &mem) != 0) {
      printf("nvml: device %u unreadable\n", i);
      continue;
    }
    printf("nvml: device %u %s %llu MiB %s\n", i, uuid, MiB(mem.total), text);
    if (nvmlDeviceGetMaxMigDeviceCount(dev, &migs) != 0) continue;  /* not in MIG mode */
    for (unsigned j = 0; j < migs; j++) {
      if (nvmlDeviceGetMigDeviceHandleByIndex(dev, j, &mig) != 0 || nvmlDeviceGetUUID(mig, uuid, sizeof uuid) != 0 ||
          nvmlDeviceGetName(mig, text, sizeof text) != 0 || nvmlDeviceGetMemoryInfo(mig, &mem) != 0)
        continue;
      printf("nvml: mig %u %u %s %llu MiB %s\n", i, j, uuid, MiB(mem.total), text);
    }
  }
  nvmlShutdown();
}

static void alloc_and_hold(unsigned long long mib) {
  int (*cuInit)(unsigned);
  int (*cuDeviceGet)(int *, int);
  int (*cuCtxCreate_v2)(void **, unsigned, int);
  int (*cuMemAlloc_v2)(unsigned long long *, size_t);
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  void *ctx;
  unsigned long long ptr;
  int dev, r;
  if (!lib) {
    printf("alloc: 0 MiB on device 0 (dlopen libcuda.so.1: %s)\n", dlerror());
    return;
  }
  if (!(cuInit = (__typeof__(cuInit))dlsym(lib, "cuInit")) ||
      !(cuDeviceGet = (__typeof__(cuDeviceGet))dlsym(lib, "cuDeviceGet")) ||
      !(cuCtxCreate_v2 = (__typeof__(cuCtxCreate_v2))dlsym(lib, "cuCtxCreate_v2")) ||
      !(cuMemAlloc_v2 = (__typeof__(cuMemAlloc_v2))dlsym(lib, "cuMemAlloc_v2"))) {
    printf("alloc: 0 MiB on device 0 (dlsym: %s)\n", dlerror());
    return;
  }
  if ((r = cuInit(0)) != 0 || (r = cuDeviceGet(&dev, 0)) != 0 || (r = cuCtxCreate_v2(&ctx, 0, dev)) != 0 ||
      (r = cuMemAlloc_v2(&ptr, (size_t)(mib << 20))) != 0) {
    printf("alloc: 0 MiB on device 0 (error %d)\n", r);
    return;
  }
  printf("alloc: %llu MiB on device 0\n", mib);
}

int main(int argc, char **argv) {
  int once = 0;
  unsigned long long alloc_mib = 0;
  for (int i = 1; i < argc; i++) {
    char *end = NULL;
    if (strcmp(argv[i], "--once") == 0) {
      once = 1;
    } else if (strcmp(argv[i], "--alloc-mib") == 0 && i + 1 < argc) {
      errno = 0;
      alloc_mib = strtoull(argv[++i], &end, 10);
      if (errno || !end || *end || alloc_mib == 0 || alloc_mib > (1ULL << 30)) {
        fprintf(stderr, "cuda-probe: --alloc-mib wants a number of MiB from 1 to 2^30, not %s\n", argv[i]);
        return 2;
      }
    } else {
      fprintf(stderr, "usage: cuda-probe [--once] [--alloc-mib N]\n");
      return 2;
    }
  }
  probe_cuda();
  probe_nvml();
  for (char **e = environ; *e; e++)
    if (strncmp(*e, "CUDA_MPS_", 9) == 0) printf("mps: %s\n", *e);
  if (alloc_mib) alloc_and_hold(alloc_mib);
  fflush(stdout);
  if (once) return 0;
  for (;;) pause();
}
