/*
 * A stand-in for libcuda.so.1: the CUDA driver API calls mn_prefect.gpucheck.visibility makes to list the devices
 * a process may use (cuInit, cuDeviceGetCount, cuDeviceGet, cuDeviceGetUuid and _v2).
 *
 * The machine is the one the fake NVML describes (FAKE_NVML_DEVICES and FAKE_NVML_MIG_DEVICES, same syntax, see
 * fake_nvml.c); UUIDs must be NVIDIA's text form (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, MIG-... for slices).
 * What CUDA does with its variables, as the real driver does it:
 *   CUDA_DEVICE_ORDER=PCI_BUS_ID   devices in NVML's order; otherwise (FASTEST_FIRST, the default) the fastest
 *                                  first, here: highest compute capability, then most memory, then NVML order;
 *   CUDA_VISIBLE_DEVICES           unset: every GPU not in MIG mode; else a comma list of ordinals (in the order
 *                                  above), GPU-/MIG- UUIDs or unique UUID prefixes; parsing stops at the first
 *                                  entry that names no device, and "" means none; with none, cuInit
 *                                  answers CUDA_ERROR_NO_DEVICE.
 * FAKE_CUDA_LOST=<uuid>[,<uuid>...]: GPUs NVML still lists that CUDA no longer enumerates (a GPU fallen off the
 *                                  bus): an ordinal or UUID naming one names no device.
 * Build: gcc -shared -fPIC -o libcuda.so.1 fake_cuda.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101

#define MAX 128
#define TEXT 96

typedef struct {
    char uuid[TEXT];
    int major, minor, mig_on, lost;
    unsigned long long total_mb;
    int nvml_index;
} gpu_t;

static gpu_t all[MAX];       /* GPUs (not slices) in NVML order, then slices */
static int n_gpus = 0, n_all = 0;
static int visible[MAX];     /* indices into all[] */
static int n_visible = 0, initialised = 0;

static void add_gpu(char *entry) {
    char *fields[8] = {0};
    int n = 0;
    for (char *f = strtok(entry, ","); f && n < 8; f = strtok(NULL, ",")) fields[n++] = f;
    if (n < 6 || n_all >= MAX) return;
    gpu_t *g = &all[n_all++];
    snprintf(g->uuid, TEXT, "%s", fields[0]);
    g->total_mb = strtoull(fields[2], NULL, 10);
    g->major = atoi(fields[4]);
    g->minor = atoi(fields[5]);
    g->mig_on = n > 6 && strcmp(fields[6], "on") == 0;
    g->nvml_index = n_gpus++;
    const char *lost = getenv("FAKE_CUDA_LOST");
    g->lost = lost && strstr(lost, g->uuid) != NULL;
}

static void add_slice(char *entry) {
    char *fields[9] = {0};
    int n = 0;
    for (char *f = strtok(entry, ","); f && n < 9; f = strtok(NULL, ",")) fields[n++] = f;
    if (n < 7 || n_all >= MAX) return;
    gpu_t *g = &all[n_all++];
    snprintf(g->uuid, TEXT, "%s", fields[2]);
    g->total_mb = strtoull(fields[5], NULL, 10);
    g->nvml_index = -1;
}

static void read_list(const char *name, void (*add)(char *)) {
    const char *value = getenv(name);
    if (!value) return;
    char *copy = strdup(value);
    char *save = NULL;
    /* strtok inside add() needs its own pass: split entries first */
    char *entries[MAX];
    int n = 0;
    for (char *e = strtok_r(copy, ";", &save); e && n < MAX; e = strtok_r(NULL, ";", &save)) entries[n++] = e;
    for (int i = 0; i < n; i++) add(entries[i]);
}

static int faster(const gpu_t *a, const gpu_t *b) { /* 1 when a comes before b in FASTEST_FIRST order */
    int ca = a->major * 10 + a->minor, cb = b->major * 10 + b->minor;
    if (ca != cb) return ca > cb;
    if (a->total_mb != b->total_mb) return a->total_mb > b->total_mb;
    return a->nvml_index < b->nvml_index;
}

int cuInit(unsigned int flags) {
    (void)flags;
    if (initialised) return CUDA_SUCCESS;
    read_list("FAKE_NVML_DEVICES", add_gpu);
    read_list("FAKE_NVML_MIG_DEVICES", add_slice);
    int order[MAX], n = 0; /* whole GPUs usable by ordinal, in CUDA's order */
    for (int i = 0; i < n_gpus; i++)
        if (!all[i].mig_on && !all[i].lost) order[n++] = i;
    const char *by_bus = getenv("CUDA_DEVICE_ORDER");
    if (!by_bus || strcmp(by_bus, "PCI_BUS_ID") != 0) {
        for (int i = 1; i < n; i++) /* insertion sort keeps it stable */
            for (int j = i; j > 0 && faster(&all[order[j]], &all[order[j - 1]]); j--) {
                int t = order[j]; order[j] = order[j - 1]; order[j - 1] = t;
            }
    }
    const char *wanted = getenv("CUDA_VISIBLE_DEVICES");
    if (!wanted) {
        for (int i = 0; i < n; i++) visible[n_visible++] = order[i];
    } else {
        char *copy = strdup(wanted), *save = NULL;
        for (char *e = strtok_r(copy, ",", &save); e; e = strtok_r(NULL, ",", &save)) {
            int found = -1;
            if (e[0] >= '0' && e[0] <= '9') {
                int k = atoi(e);
                if (k < n) found = order[k];
            } else {
                for (int i = 0; i < n_all; i++)
                    if (strncmp(all[i].uuid, e, strlen(e)) == 0 && !all[i].lost && !(i < n_gpus && all[i].mig_on)) {
                        found = i;
                        break;
                    }
            }
            if (found < 0) break;
            visible[n_visible++] = found;
        }
        free(copy);
    }
    if (n_visible == 0) return CUDA_ERROR_NO_DEVICE; /* as the driver does: no device, no initialised API */
    initialised = 1;
    return CUDA_SUCCESS;
}

int cuDeviceGetCount(int *count) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    *count = n_visible;
    return CUDA_SUCCESS;
}

int cuDeviceGet(int *device, int ordinal) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= n_visible) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

static int hex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int cuDeviceGetUuid_v2(unsigned char *uuid, int device) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (device < 0 || device >= n_visible) return CUDA_ERROR_INVALID_DEVICE;
    const char *text = strchr(all[visible[device]].uuid, '-');
    int nibbles = 0;
    memset(uuid, 0, 16);
    for (const char *p = text ? text + 1 : ""; *p && nibbles < 32; p++) {
        int v = hex(*p);
        if (v < 0) continue;
        uuid[nibbles / 2] |= (unsigned char)(nibbles % 2 ? v : v << 4);
        nibbles++;
    }
    return nibbles == 32 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

int cuDeviceGetUuid(unsigned char *uuid, int device) { return cuDeviceGetUuid_v2(uuid, device); }
