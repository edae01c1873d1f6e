/* The simulated node's GPUs as the CUDA stand-in sees them: parsed from a read-only listing the plugin of a
 * simulated node writes (dra/sim/standin.py) and mounts into every GPU container, filtered by the device
 * nodes this process can open. A device whose node the container did not get is never listed. */
#ifndef GPU_DRA_STANDIN_LISTING_H
#define GPU_DRA_STANDIN_LISTING_H

#include <stddef.h>

#define LISTING_PATH "/run/nvidia-sim/gpus"
/* Tests on a host point the stand-in at another listing. Only the calling process is affected. */
#define LISTING_ENV "GPU_DRA_SIM_GPUS"
/* Where libcuda registers processes that created a context (writable; see libcuda.c). */
#define PROCS_PATH "/run/nvidia-sim-procs"
#define PROCS_ENV "GPU_DRA_SIM_PROCS"

#define MAX_GPUS 64
#define MAX_MIGS 512
#define FIELD 128

struct sim_node {
  char path[FIELD];
  unsigned major, minor;
};

struct sim_gpu {
  unsigned index;
  struct sim_node node;
  int mig_mode;
  char uuid[FIELD];
  unsigned long long memory;   /* bytes */
  char name[FIELD];
  int usable;                  /* its node opens here */
};

struct sim_mig {
  unsigned gpu_index;
  unsigned gi, ci;
  struct sim_node gi_cap, ci_cap;
  char uuid[FIELD];
  unsigned long long memory;
  char name[FIELD];
  int usable;                  /* parent, GI and CI nodes all open here */
  struct sim_gpu *parent;
};

struct sim_listing {
  char driver_version[FIELD];
  int cuda_version;
  struct sim_node ctl;
  int ctl_usable;
  size_t ngpus, nmigs;
  struct sim_gpu gpus[MAX_GPUS];
  struct sim_mig migs[MAX_MIGS];
};

/* Reads the listing and checks every node. 0 on success, else -1 with errno (ENOENT: no listing; EINVAL: a
 * malformed line). */
int sim_load(struct sim_listing *out);

/* Whether the character device at node->path has node's numbers and this process may use it: it opens, or
 * the kernel has no driver behind it (ENXIO/ENODEV: a simulated node's device created by the runtime from
 * its major:minor, allowed by the device cgroup). A missing node or a refused open (EPERM, EACCES) is not. */
int sim_node_usable(const struct sim_node *node);

/* The 16 bytes of a "GPU-..." or "MIG-..." UUID; 0 on success. */
int sim_uuid_bytes(const char *uuid, unsigned char out[16]);

/* Copies src into dst of size n (n > 0); -1 when it did not fit (dst then holds a truncated copy). */
int sim_copy(char *dst, size_t n, const char *src);

#endif
