/* nvidia-smi stand-in for simulated nodes: `-L` lists the GPUs and MIG devices NVML shows this process, in the
 * real tool's format; like the real one it loads libnvidia-ml.so.1 by soname. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;

#define LOAD(sym) \
  if (!(sym = (__typeof__(sym))dlsym(lib, #sym))) { \
    fprintf(stderr, "nvidia-smi: %s is missing from libnvidia-ml.so.1\n", #sym); \
    return 9; \
  }

static nvmlReturn_t (*nvmlInit_v2)(void);
static nvmlReturn_t (*nvmlShutdown)(void);
static const char *(*nvmlErrorString)(nvmlReturn_t);
static nvmlReturn_t (*nvmlDeviceGetCount_v2)(unsigned *);
static nvmlReturn_t (*nvmlDeviceGetHandleByIndex_v2)(unsigned, nvmlDevice_t *);
static nvmlReturn_t (*nvmlDeviceGetUUID)(nvmlDevice_t, char *, unsigned);
static nvmlReturn_t (*nvmlDeviceGetName)(nvmlDevice_t, char *, unsigned);
static nvmlReturn_t (*nvmlDeviceGetMaxMigDeviceCount)(nvmlDevice_t, unsigned *);
static nvmlReturn_t (*nvmlDeviceGetMigDeviceHandleByIndex)(nvmlDevice_t, unsigned, nvmlDevice_t *);

/* "NVIDIA H100 80GB HBM3 MIG 3g.40gb" -> "3g.40gb" */
static const char *profile_of(const char *name) {
  const char *p = strstr(name, " MIG ");
  return p ? p + 5 : name;
}

static int list(void) {
  unsigned count = 0;
  nvmlReturn_t r = nvmlDeviceGetCount_v2(&count);
  if (r != 0) {
    fprintf(stderr, "Failed to count GPUs: %s\n", nvmlErrorString(r));
    return 15;
  }
  if (count == 0) {
    printf("No devices found.\n");
    return 6;
  }
  for (unsigned i = 0; i < count; i++) {
    nvmlDevice_t dev;
    char uuid[96] = "", name[96] = "";
    if (nvmlDeviceGetHandleByIndex_v2(i, &dev) != 0) continue;
    nvmlDeviceGetUUID(dev, uuid, sizeof uuid);
    nvmlDeviceGetName(dev, name, sizeof name);
    printf("GPU %u: %s (UUID: %s)\n", i, name, uuid);
    unsigned migs = 0;
    if (nvmlDeviceGetMaxMigDeviceCount(dev, &migs) != 0) continue;
    for (unsigned j = 0; j < migs; j++) {
      nvmlDevice_t mig;
      if (nvmlDeviceGetMigDeviceHandleByIndex(dev, j, &mig) != 0) continue;
      nvmlDeviceGetUUID(mig, uuid, sizeof uuid);
      nvmlDeviceGetName(mig, name, sizeof name);
      printf("  MIG %-11s Device %2u: (UUID: %s)\n", profile_of(name), j, uuid);
    }
  }
  return 0;
}

int main(int argc, char **argv) {
  int list_only = argc == 2 && (strcmp(argv[1], "-L") == 0 || strcmp(argv[1], "--list-gpus") == 0);
  if (argc > 1 && !list_only) {
    fprintf(stderr, "nvidia-smi (simulated node): only -L / --list-gpus is supported, not '%s'\n", argv[1]);
    return 2;
  }
  void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  if (!lib) {
    fprintf(stderr, "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. (%s)\n", dlerror());
    return 12;
  }
  LOAD(nvmlInit_v2) LOAD(nvmlShutdown) LOAD(nvmlErrorString) LOAD(nvmlDeviceGetCount_v2)
  LOAD(nvmlDeviceGetHandleByIndex_v2) LOAD(nvmlDeviceGetUUID) LOAD(nvmlDeviceGetName)
  LOAD(nvmlDeviceGetMaxMigDeviceCount) LOAD(nvmlDeviceGetMigDeviceHandleByIndex)
  nvmlReturn_t r = nvmlInit_v2();
  if (r != 0) {
    fprintf(stderr, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver (%s).\n",
            nvmlErrorString(r));
    return 9;
  }
  int rc = list();
  nvmlShutdown();
  return rc;
}
