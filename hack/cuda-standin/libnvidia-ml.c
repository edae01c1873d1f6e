/* libnvidia-ml.so.1 stand-in for simulated nodes: the NVML entry points a probe and the stand-in nvidia-smi
 * need, answering from the node's GPU listing and the device nodes this container can open (listing.h).
 * NVML counts physical GPUs (a GPU in MIG mode included); its MIG devices are reached through the parent's
 * handle, each only when its GI and CI capability nodes open. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "listing.h"

#define API __attribute__((visibility("default")))

typedef int nvmlReturn_t;
typedef struct nvml_device *nvmlDevice_t;
typedef struct {
  unsigned long long total, free, used;
} nvmlMemory_t;

enum {
  NVML_SUCCESS = 0,
  NVML_ERROR_UNINITIALIZED = 1,
  NVML_ERROR_INVALID_ARGUMENT = 2,
  NVML_ERROR_NOT_SUPPORTED = 3,
  NVML_ERROR_NOT_FOUND = 6,
  NVML_ERROR_INSUFFICIENT_SIZE = 7,
  NVML_ERROR_DRIVER_NOT_LOADED = 9,
  NVML_ERROR_UNKNOWN = 999,
};

struct nvml_device {
  const char *uuid, *name;
  unsigned long long memory;
  int mig_mode;           /* GPUs */
  int is_mig;
  nvmlDevice_t migs[MAX_MIGS];
  unsigned nmigs;
};

static struct sim_listing listing;
static struct nvml_device gpus[MAX_GPUS], migs[MAX_MIGS];
static unsigned ngpus;
static nvmlReturn_t load_result = NVML_ERROR_UNINITIALIZED;
static int refs;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void load(void) {
  if (sim_load(&listing) != 0) {
    load_result = NVML_ERROR_DRIVER_NOT_LOADED;
    return;
  }
  if (!listing.ctl_usable) {  /* no /dev/nvidiactl: the real library cannot reach the driver either */
    load_result = NVML_ERROR_DRIVER_NOT_LOADED;
    return;
  }
  unsigned nmig = 0;
  for (size_t i = 0; i < listing.ngpus; i++) {
    struct sim_gpu *g = &listing.gpus[i];
    if (!g->usable) continue;
    struct nvml_device *d = &gpus[ngpus++];
    *d = (struct nvml_device){.uuid = g->uuid, .name = g->name, .memory = g->memory, .mig_mode = g->mig_mode};
    for (size_t j = 0; j < listing.nmigs; j++) {
      struct sim_mig *m = &listing.migs[j];
      if (m->parent != g || !m->usable) continue;
      migs[nmig] = (struct nvml_device){.uuid = m->uuid, .name = m->name, .memory = m->memory, .is_mig = 1};
      d->migs[d->nmigs++] = &migs[nmig++];
    }
  }
  load_result = NVML_SUCCESS;
}

static nvmlReturn_t ready(void) {
  pthread_mutex_lock(&lock);
  int ok = refs > 0;
  pthread_mutex_unlock(&lock);
  return ok ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

static int known(nvmlDevice_t d) {
  return d && ((d >= gpus && d < gpus + ngpus) || (d >= migs && d < migs + MAX_MIGS && d->is_mig));
}

static nvmlReturn_t copy_out(char *dst, unsigned int len, const char *src) {
  if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
  if (strlen(src) >= len) return NVML_ERROR_INSUFFICIENT_SIZE;
  memcpy(dst, src, strlen(src) + 1);
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlInit_v2(void) {
  pthread_once(&once, load);
  if (load_result != NVML_SUCCESS) return load_result;
  pthread_mutex_lock(&lock);
  refs++;
  pthread_mutex_unlock(&lock);
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }

API nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
  (void)flags;
  return nvmlInit_v2();
}

API nvmlReturn_t nvmlShutdown(void) {
  pthread_mutex_lock(&lock);
  nvmlReturn_t r = refs > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
  if (refs > 0) refs--;
  pthread_mutex_unlock(&lock);
  return r;
}

API const char *nvmlErrorString(nvmlReturn_t result) {
  switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    default: return "Unknown Error";
  }
}

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int len) {
  nvmlReturn_t r = ready();
  return r != NVML_SUCCESS ? r : copy_out(version, len, listing.driver_version);
}

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
  if (!count) return NVML_ERROR_INVALID_ARGUMENT;
  nvmlReturn_t r = ready();
  if (r == NVML_SUCCESS) *count = ngpus;
  return r;
}

API nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
  if (!device) return NVML_ERROR_INVALID_ARGUMENT;
  nvmlReturn_t r = ready();
  if (r != NVML_SUCCESS) return r;
  if (index >= ngpus) return NVML_ERROR_INVALID_ARGUMENT;
  *device = &gpus[index];
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
  return nvmlDeviceGetHandleByIndex_v2(index, device);
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int len) {
  nvmlReturn_t r = ready();
  if (r != NVML_SUCCESS) return r;
  return known(device) ? copy_out(uuid, len, device->uuid) : NVML_ERROR_INVALID_ARGUMENT;
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int len) {
  nvmlReturn_t r = ready();
  if (r != NVML_SUCCESS) return r;
  return known(device) ? copy_out(name, len, device->name) : NVML_ERROR_INVALID_ARGUMENT;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
  nvmlReturn_t r = ready();
  if (r != NVML_SUCCESS) return r;
  if (!known(device) || !memory) return NVML_ERROR_INVALID_ARGUMENT;
  memory->total = memory->free = device->memory;
  memory->used = 0;
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
  nvmlReturn_t r = ready();
  if (r != NVML_SUCCESS) return r;
  if (!known(device) || !current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
  if (device->is_mig) return NVML_ERROR_NOT_SUPPORTED;
  *current = *pending = (unsigned)device->mig_mode;
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
  nvmlReturn_t r = ready();
  if (r != NVML_SUCCESS) return r;
  if (!known(device) || !count) return NVML_ERROR_INVALID_ARGUMENT;
  if (device->is_mig || !device->mig_mode) return NVML_ERROR_NOT_SUPPORTED;
  *count = device->nmigs;
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *mig) {
  nvmlReturn_t r = ready();
  if (r != NVML_SUCCESS) return r;
  if (!known(device) || !mig || device->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
  if (index >= device->nmigs) return NVML_ERROR_NOT_FOUND;
  *mig = device->migs[index];
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *is_mig) {
  if (!known(device) || !is_mig) return NVML_ERROR_INVALID_ARGUMENT;
  *is_mig = (unsigned)device->is_mig;
  return NVML_SUCCESS;
}
