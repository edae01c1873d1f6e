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
 * then sleeps, so a pod stays running, unless given --once. */
#include <dlfcn.h>
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

int main(int argc, char **argv) {
  int once = argc > 1 && strcmp(argv[1], "--once") == 0;
  if (argc > 1 && !once) {
    fprintf(stderr, "usage: cuda-probe [--once]\n");
    return 2;
  }
  probe_cuda();
  probe_nvml();
  for (char **e = environ; *e; e++)
    if (strncmp(*e, "CUDA_MPS_", 9) == 0) printf("mps: %s\n", *e);
  fflush(stdout);
  if (once) return 0;
  for (;;) pause();
}
