/* See listing.h. Line format (fields separated by one space, the name last and free-form):
 *   driver <version> <cuda version, e.g. 13000>
 *   ctl <path> <major> <minor>
 *   gpu <index> <path> <major> <minor> <mig mode 0|1> <uuid> <memory bytes> <name>
 *   mig <gpu index> <gi> <ci> <gi cap path> <major> <minor> <ci cap path> <major> <minor> <uuid> <bytes> <name>
 * '#' starts a comment line. */
#define _GNU_SOURCE
#include "listing.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

int sim_copy(char *dst, size_t n, const char *src) {
  size_t len = strlen(src);
  if (len >= n) {
    memcpy(dst, src, n - 1);
    dst[n - 1] = '\0';
    return -1;
  }
  memcpy(dst, src, len + 1);
  return 0;
}

int sim_node_usable(const struct sim_node *node) {
  struct stat st;
  if (stat(node->path, &st) != 0 || !S_ISCHR(st.st_mode)) return 0;
  if (major(st.st_rdev) != node->major || minor(st.st_rdev) != node->minor) return 0;
  int fd = open(node->path, O_RDWR | O_CLOEXEC | O_NOCTTY);
  if (fd >= 0) {
    close(fd);
    return 1;
  }
  return errno == ENXIO || errno == ENODEV;
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

int sim_uuid_bytes(const char *uuid, unsigned char out[16]) {
  if (strncmp(uuid, "GPU-", 4) != 0 && strncmp(uuid, "MIG-", 4) != 0) return -1;
  size_t n = 0;
  for (const char *p = uuid + 4; *p; p++) {
    if (*p == '-') continue;
    int hi = hexval(*p), lo = p[1] ? hexval(p[1]) : -1;
    if (hi < 0 || lo < 0 || n == 16) return -1;
    out[n++] = (unsigned char)(hi << 4 | lo);
    p++;
  }
  return n == 16 ? 0 : -1;
}

/* The rest of the line after `consumed` characters, as the name (trailing newline removed). */
static int take_name(char *dst, const char *line, int consumed) {
  const char *rest = line + consumed;
  while (*rest == ' ') rest++;
  if (!*rest) return -1;
  sim_copy(dst, FIELD, rest);
  dst[strcspn(dst, "\n")] = '\0';
  return dst[0] ? 0 : -1;
}

static int parse_line(struct sim_listing *l, const char *line) {
  char kind[16];
  int n = 0;
  if (line[0] == '#' || line[0] == '\n' || line[0] == '\0') return 0;
  if (sscanf(line, "%15s%n", kind, &n) != 1) return 0;
  if (strcmp(kind, "driver") == 0) {
    return sscanf(line, "driver %127s %d", l->driver_version, &l->cuda_version) == 2 ? 0 : -1;
  }
  if (strcmp(kind, "ctl") == 0) {
    return sscanf(line, "ctl %127s %u %u", l->ctl.path, &l->ctl.major, &l->ctl.minor) == 3 ? 0 : -1;
  }
  if (strcmp(kind, "gpu") == 0) {
    if (l->ngpus == MAX_GPUS) return -1;
    struct sim_gpu *g = &l->gpus[l->ngpus];
    memset(g, 0, sizeof *g);
    if (sscanf(line, "gpu %u %127s %u %u %d %127s %llu %n", &g->index, g->node.path, &g->node.major,
               &g->node.minor, &g->mig_mode, g->uuid, &g->memory, &n) != 7 || take_name(g->name, line, n) != 0)
      return -1;
    l->ngpus++;
    return 0;
  }
  if (strcmp(kind, "mig") == 0) {
    if (l->nmigs == MAX_MIGS) return -1;
    struct sim_mig *m = &l->migs[l->nmigs];
    memset(m, 0, sizeof *m);
    if (sscanf(line, "mig %u %u %u %127s %u %u %127s %u %u %127s %llu %n", &m->gpu_index, &m->gi, &m->ci,
               m->gi_cap.path, &m->gi_cap.major, &m->gi_cap.minor, m->ci_cap.path, &m->ci_cap.major,
               &m->ci_cap.minor, m->uuid, &m->memory, &n) != 11 || take_name(m->name, line, n) != 0)
      return -1;
    l->nmigs++;
    return 0;
  }
  return 0; /* unknown kinds are for newer readers */
}

int sim_load(struct sim_listing *l) {
  const char *path = getenv(LISTING_ENV);
  if (!path || !*path) path = LISTING_PATH;
  memset(l, 0, sizeof *l);
  FILE *f = fopen(path, "re");
  if (!f) return -1;
  char line[1024];
  int bad = 0;
  while (fgets(line, sizeof line, f)) {
    if (parse_line(l, line) != 0) bad = 1;
  }
  fclose(f);
  if (bad || !l->driver_version[0] || !l->ctl.path[0]) {
    errno = EINVAL;
    return -1;
  }
  l->ctl_usable = sim_node_usable(&l->ctl);
  for (size_t i = 0; i < l->ngpus; i++) l->gpus[i].usable = l->ctl_usable && sim_node_usable(&l->gpus[i].node);
  for (size_t i = 0; i < l->nmigs; i++) {
    struct sim_mig *m = &l->migs[i];
    for (size_t j = 0; j < l->ngpus; j++)
      if (l->gpus[j].index == m->gpu_index) m->parent = &l->gpus[j];
    m->usable = m->parent && m->parent->usable && m->parent->mig_mode && sim_node_usable(&m->gi_cap) &&
                sim_node_usable(&m->ci_cap);
  }
  return 0;
}
