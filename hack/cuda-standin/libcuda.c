/* libcuda.so.1 stand-in for simulated nodes: the driver API entry points a probe needs, answering from the
 * node's GPU listing and the device nodes this container can open (listing.h). CUDA lists a GPU in MIG mode
 * as its MIG devices, each only when the GPU's node and its GI and CI capability nodes all open.
 *
 * Contexts and memory: cuCtxCreate and cuMemAlloc register the calling process with the simulated driver, as
 * the real driver knows which processes hold memory on which GPU. A registration is a small file in the node's
 * process directory (PROCS_PATH, writable, mounted into every GPU container of a simulated node), one per
 * context, naming this process the way the host can find it again: its PID namespace's inode, its PID in that
 * namespace and its start time (both read in /proc/<host pid> on the host). The simulated NVML answers
 * nvmlDeviceGetComputeRunningProcesses from these files (dra/sim/gpuprocesses.py). No device memory exists:
 * allocations are counted, never backed.
 *
 * MPS: cuInit connects to the control daemon's socket in CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps), as
 * CUDA does, and asks for a server of this process's user ("new_client", dra/sim/mpscontrol.py), waiting while a
 * server of another user runs; the connection is held for the process's life. Where no daemon can be reached
 * (no socket, no permission), CUDA runs without MPS, and so does the stand-in. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "listing.h"

#define API __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef struct { char bytes[16]; } CUuuid;
typedef struct cu_ctx *CUcontext;
typedef unsigned long long CUdeviceptr;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
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
static pthread_once_t mps_once = PTHREAD_ONCE_INIT;
static int mps_fd = -1;   /* the connection to the MPS control daemon, held while the process lives */
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

static void mps_connect(void) {
  static const char hello[] = "new_client\n";
  const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  char reply[64];
  ssize_t n = -1;
  if (!dir || !*dir) dir = "/tmp/nvidia-mps";
  if ((size_t)snprintf(addr.sun_path, sizeof addr.sun_path, "%s/control", dir) >= sizeof addr.sun_path) return;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  if (connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0 &&
      write(fd, hello, sizeof hello - 1) == (ssize_t)(sizeof hello - 1))
    n = read(fd, reply, sizeof reply - 1);   /* blocks while a server of another user runs */
  if (n >= 3 && memcmp(reply, "OK ", 3) == 0)
    mps_fd = fd;
  else
    close(fd);
}

API CUresult cuInit(unsigned int flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  pthread_once(&once, load);
  if (init_result == CUDA_SUCCESS) pthread_once(&mps_once, mps_connect);
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
    case CUDA_ERROR_OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; break;
    case CUDA_ERROR_INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_OPERATING_SYSTEM: *name = "CUDA_ERROR_OPERATING_SYSTEM"; break;
    case CUDA_ERROR_NOT_FOUND: *name = "CUDA_ERROR_NOT_FOUND"; break;
    default: *name = NULL; return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

/* ---- contexts and memory ------------------------------------------------------------------------------- */

#define MAX_ALLOCS 4096
/* Fake device addresses: distinct, never dereferenced. */
#define ADDRESS_BASE 0x7f0000000000ULL

struct cu_ctx {
  int dev;
  unsigned serial;
  unsigned long long allocated;
  char path[PATH_MAX];   /* the registration file ("" when none could be written) */
};

static struct { CUdeviceptr ptr; size_t bytes; struct cu_ctx *ctx; } allocs[MAX_ALLOCS];
static CUdeviceptr next_address = ADDRESS_BASE;
static unsigned next_serial;
static struct cu_ctx *current;   /* one current context for the process: the stand-in keeps no per-thread stack */

static const char *procs_dir(void) {
  const char *dir = getenv(PROCS_ENV);
  return dir && *dir ? dir : PROCS_PATH;
}

/* Field 22 of /proc/self/stat: clock ticks after boot, the same number the host reads for this process. */
static unsigned long long self_start_time(void) {
  char buf[1024];
  FILE *f = fopen("/proc/self/stat", "re");
  if (!f) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  char *p = strrchr(buf, ')');
  if (!p) return 0;
  p++;
  for (int field = 3; field < 22 && p; field++) p = strchr(p + 1, ' ');
  return p ? strtoull(p + 1, NULL, 10) : 0;
}

/* Writes (or rewrites) the context's registration: temporary file, then rename, so a reader sees one whole
 * line. Failing to register is not a CUDA error: real programs never see the bookkeeping. Called locked. */
static void register_ctx(struct cu_ctx *ctx) {
  struct stat ns;
  const char *dir = procs_dir();
  if (stat("/proc/self/ns/pid", &ns) != 0) return;
  const char *mps = getenv("CUDA_MPS_PIPE_DIRECTORY");
  unsigned long long start = self_start_time();
  if (!ctx->path[0])
    snprintf(ctx->path, sizeof ctx->path, "%s/%llu-%d-%llu-%u", dir, (unsigned long long)ns.st_ino, (int)getpid(),
             start, ctx->serial);
  char tmp[PATH_MAX + 8];
  snprintf(tmp, sizeof tmp, "%s.tmp", ctx->path);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) return;
  char line[512];
  int len = snprintf(line, sizeof line, "v1 %llu %d %llu %d %llu %s\n", (unsigned long long)ns.st_ino,
                     (int)getpid(), start, mps && *mps ? 1 : 0, ctx->allocated, devices[ctx->dev].uuid);
  int ok = len > 0 && len < (int)sizeof line && write(fd, line, (size_t)len) == len;
  if (close(fd) != 0) ok = 0;
  if (!ok || rename(tmp, ctx->path) != 0) unlink(tmp);
}

API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
  (void)flags;
  if (!pctx) return CUDA_ERROR_INVALID_VALUE;
  CUresult r = ready();
  if (r != CUDA_SUCCESS) return r;
  if (!device(dev)) return CUDA_ERROR_INVALID_DEVICE;
  struct cu_ctx *ctx = calloc(1, sizeof *ctx);
  if (!ctx) return CUDA_ERROR_OUT_OF_MEMORY;
  pthread_mutex_lock(&lock);
  ctx->dev = dev;
  ctx->serial = next_serial++;
  register_ctx(ctx);
  current = ctx;
  pthread_mutex_unlock(&lock);
  *pctx = ctx;
  return CUDA_SUCCESS;
}

API CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) { return cuCtxCreate_v2(pctx, flags, dev); }

API CUresult cuCtxDestroy_v2(CUcontext ctx) {
  if (!ctx) return CUDA_ERROR_INVALID_CONTEXT;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < MAX_ALLOCS; i++)
    if (allocs[i].ctx == ctx) allocs[i].ctx = NULL;   /* its memory goes with it */
  if (ctx->path[0]) unlink(ctx->path);
  if (current == ctx) current = NULL;
  pthread_mutex_unlock(&lock);
  free(ctx);
  return CUDA_SUCCESS;
}

API CUresult cuCtxDestroy(CUcontext ctx) { return cuCtxDestroy_v2(ctx); }

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
  if (!dptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&lock);
  struct cu_ctx *ctx = current;
  CUresult r = CUDA_SUCCESS;
  size_t slot = MAX_ALLOCS;
  for (size_t i = 0; ctx && i < MAX_ALLOCS && slot == MAX_ALLOCS; i++)
    if (!allocs[i].ctx) slot = i;
  if (!ctx)
    r = CUDA_ERROR_INVALID_CONTEXT;
  else if (slot == MAX_ALLOCS || bytes > devices[ctx->dev].memory - ctx->allocated)
    r = CUDA_ERROR_OUT_OF_MEMORY;
  else {
    allocs[slot].ptr = next_address;
    allocs[slot].bytes = bytes;
    allocs[slot].ctx = ctx;
    next_address += (bytes + 0xfffffULL) & ~0xfffffULL;   /* 1 MiB aligned, never reused */
    ctx->allocated += bytes;
    *dptr = allocs[slot].ptr;
    register_ctx(ctx);
  }
  pthread_mutex_unlock(&lock);
  return r;
}

API CUresult cuMemAlloc(CUdeviceptr *dptr, size_t bytes) { return cuMemAlloc_v2(dptr, bytes); }

API CUresult cuMemFree_v2(CUdeviceptr ptr) {
  CUresult r = CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < MAX_ALLOCS; i++) {
    if (allocs[i].ctx && allocs[i].ptr == ptr) {
      allocs[i].ctx->allocated -= allocs[i].bytes;
      register_ctx(allocs[i].ctx);
      allocs[i].ctx = NULL;
      r = CUDA_SUCCESS;
      break;
    }
  }
  pthread_mutex_unlock(&lock);
  return r;
}

API CUresult cuMemFree(CUdeviceptr ptr) { return cuMemFree_v2(ptr); }
