/* libcuda.so.1 stand-in for simulated nodes: the driver API entry points a probe needs, answering from the
 * node's GPU listing and the device nodes this container can open (listing.h). CUDA lists a GPU in MIG mode
 * as its MIG devices, each only when the GPU's node and its GI and CI capability nodes all open. */
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "listing.h"

#define API __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef struct { char bytes[16]; } CUuuid;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_OPERATING_SYSTEM = 304,
  CUDA_ERROR_NOT_FOUND = 500,
};

struct cu_device {
  const char *uuid, *name;
  unsigned long long memory;
};

static struct sim_listing listing;
static struct cu_device devices[MAX_GPUS + MAX_MIGS];
static int ndevices;
static CUresult init_result = CUDA_ERROR_NOT_INITIALIZED;
static int initialised;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void load(void) {
  if (sim_load(&listing) != 0) {
    init_result = CUDA_ERROR_OPERATING_SYSTEM;
    return;
  }
  for (size_t i = 0; i < listing.ngpus; i++) {
    struct sim_gpu *g = &listing.gpus[i];
    if (g->usable && !g->mig_mode) devices[ndevices++] = (struct cu_device){g->uuid, g->name, g->memory};
    for (size_t j = 0; g->mig_mode && j < listing.nmigs; j++) {
      struct sim_mig *m = &listing.migs[j];
      if (m->parent == g && m->usable) devices[ndevices++] = (struct cu_device){m->uuid, m->name, m->memory};
    }
  }
  init_result = ndevices > 0 ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
}

static CUresult ready(void) {
  pthread_mutex_lock(&lock);
  int ok = initialised;
  pthread_mutex_unlock(&lock);
  return ok ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

static const struct cu_device *device(CUdevice dev) {
  return dev >= 0 && dev < ndevices ? &devices[dev] : NULL;
}

API CUresult cuInit(unsigned int flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  pthread_once(&once, load);
  pthread_mutex_lock(&lock);
  initialised = init_result == CUDA_SUCCESS;
  pthread_mutex_unlock(&lock);
  return init_result;
}

API CUresult cuDriverGetVersion(int *version) {
  if (!version) return CUDA_ERROR_INVALID_VALUE;
  pthread_once(&once, load);
  if (!listing.driver_version[0]) return CUDA_ERROR_OPERATING_SYSTEM;
  *version = listing.cuda_version;
  return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int *count) {
  if (!count) return CUDA_ERROR_INVALID_VALUE;
  CUresult r = ready();
  if (r == CUDA_SUCCESS) *count = ndevices;
  return r;
}

API CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
  if (!dev) return CUDA_ERROR_INVALID_VALUE;
  CUresult r = ready();
  if (r != CUDA_SUCCESS) return r;
  if (!device(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *dev = ordinal;
  return CUDA_SUCCESS;
}

API CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
  if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  CUresult r = ready();
  if (r != CUDA_SUCCESS) return r;
  const struct cu_device *d = device(dev);
  if (!d) return CUDA_ERROR_INVALID_DEVICE;
  sim_copy(name, (size_t)len, d->name);  /* CUDA truncates too */
  return CUDA_SUCCESS;
}

API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
  if (!uuid) return CUDA_ERROR_INVALID_VALUE;
  CUresult r = ready();
  if (r != CUDA_SUCCESS) return r;
  const struct cu_device *d = device(dev);
  if (!d) return CUDA_ERROR_INVALID_DEVICE;
  unsigned char bytes[16];
  if (sim_uuid_bytes(d->uuid, bytes) != 0) return CUDA_ERROR_NOT_FOUND;
  memcpy(uuid->bytes, bytes, 16);
  return CUDA_SUCCESS;
}

/* Before CUDA 11.4 a MIG device answered with its parent's UUID here; the stand-in does not model that. */
API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid_v2(uuid, dev); }

API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
  if (!bytes) return CUDA_ERROR_INVALID_VALUE;
  CUresult r = ready();
  if (r != CUDA_SUCCESS) return r;
  const struct cu_device *d = device(dev);
  if (!d) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = (size_t)d->memory;
  return CUDA_SUCCESS;
}

/* The pre-3.2 ABI: a 32-bit count, clamped. */
API CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
  size_t full = 0;
  if (!bytes) return CUDA_ERROR_INVALID_VALUE;
  CUresult r = cuDeviceTotalMem_v2(&full, dev);
  if (r == CUDA_SUCCESS) *bytes = full > UINT_MAX ? UINT_MAX : (unsigned int)full;
  return r;
}

API CUresult cuGetErrorName(CUresult error, const char **name) {
  if (!name) return CUDA_ERROR_INVALID_VALUE;
  switch (error) {
    case CUDA_SUCCESS: *name = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; break;
    case CUDA_ERROR_INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_OPERATING_SYSTEM: *name = "CUDA_ERROR_OPERATING_SYSTEM"; break;
    case CUDA_ERROR_NOT_FOUND: *name = "CUDA_ERROR_NOT_FOUND"; break;
    default: *name = NULL; return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}
