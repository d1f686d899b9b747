/*
 * A stand-in for libnvidia-ml.so.1: the NVML entry points pynvml calls for inventory detection.
 *
 * Devices come from FAKE_NVML_DEVICES, ';'-separated, each "uuid,name,total_mb,free_mb,cc_major,cc_minor[,mig]":
 *   FAKE_NVML_DEVICES="GPU-aaa,NVIDIA A100,40960,40000,8,0;GPU-bbb,Tesla T4,16384,16000,7,5"
 * The optional last field is the MIG mode: "on" (enabled), "off" (MIG-capable, disabled); without it the
 * device has no MIG support (nvmlDeviceGetMigMode returns NVML_ERROR_NOT_SUPPORTED).
 *
 * MIG slices come from FAKE_NVML_MIG_DEVICES, ';'-separated, each
 * "parent_uuid,slot,uuid,gpu_slices,memory_size_mb,total_mb,free_mb[,compute_slices]":
 *   FAKE_NVML_MIG_DEVICES="GPU-aaa,0,MIG-a0,1,9984,9856,9800;GPU-aaa,2,MIG-a2,3,40192,40064,40000,1"
 * slot is the index nvmlDeviceGetMigDeviceHandleByIndex takes (0-6; a slot without a slice is
 * NVML_ERROR_NOT_FOUND); gpu_slices, compute_slices (default gpu_slices) and memory_size_mb are what
 * nvmlDeviceGetAttributes_v2 reports; total_mb and free_mb what nvmlDeviceGetMemoryInfo reports.
 *
 * FAKE_NVML_USE_FILE names a file of lines "uuid,gpu_percent,memory_used_mb", read again at every
 * nvmlDeviceGetUtilizationRates and nvmlDeviceGetMemoryInfo call (what a test turns to make a booked GPU busy
 * or idle, or use more memory): a device it names reports that utilisation and that much memory used; any
 * other reports 0% and the free_mb it was described with.
 *
 * FAKE_NVML_INIT_RESULT=<int> makes nvmlInit* return that NVML error code (9 = DRIVER_NOT_LOADED).
 * A device or slice whose uuid is "ERR" makes nvmlDeviceGetUUID return 999 (NVML_ERROR_UNKNOWN).
 *
 * Build: gcc -shared -fPIC -o libnvidia-ml.so.1 fake_nvml.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_UNKNOWN 999

#define MAX_DEVICES 16
#define MIG_SLOTS 7
#define MAX_SLICES (MAX_DEVICES * MIG_SLOTS)
#define TEXT 96

enum mig_support { MIG_UNSUPPORTED, MIG_DISABLED, MIG_ENABLED };

typedef struct {
    char uuid[TEXT];
    char name[TEXT];
    unsigned long long total_mb;
    unsigned long long free_mb;
    int major;
    int minor;
    enum mig_support mig;
} fake_device;

typedef struct {
    unsigned int parent;
    unsigned int slot;
    char uuid[TEXT];
    unsigned int gpu_slices;
    unsigned int compute_slices;
    unsigned long long memory_size_mb;
    unsigned long long total_mb;
    unsigned long long free_mb;
} fake_slice;

typedef struct {
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    unsigned int gpuInstanceSliceCount;
    unsigned int computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

static fake_device devices[MAX_DEVICES];
static unsigned int device_count = 0;
static fake_slice slices[MAX_SLICES];
static unsigned int slice_count = 0;
static int initialised = 0;

static void copy_field(char *dst, const char *src) { snprintf(dst, TEXT, "%s", src); }

/* Split a ','-separated entry into at most max fields; returns how many. */
static int split_fields(char *entry, char **fields, int max) {
    int n = 0;
    char *save = NULL;
    for (char *tok = strtok_r(entry, ",", &save); tok && n < max; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ') tok++;
        fields[n++] = tok;
    }
    return n;
}

/* Parse one "uuid,name,total,free,major,minor[,mig]" entry into devices[device_count]. */
static void parse_device(char *entry) {
    char *fields[7] = {0};
    int n = split_fields(entry, fields, 7);
    if (n < 1 || device_count >= MAX_DEVICES) return;
    fake_device *d = &devices[device_count++];
    memset(d, 0, sizeof *d);
    copy_field(d->uuid, fields[0]);
    copy_field(d->name, n > 1 ? fields[1] : "Fake GPU");
    d->total_mb = n > 2 ? strtoull(fields[2], NULL, 10) : 0;
    d->free_mb = n > 3 ? strtoull(fields[3], NULL, 10) : 0;
    d->major = n > 4 ? atoi(fields[4]) : 0;
    d->minor = n > 5 ? atoi(fields[5]) : 0;
    d->mig = n < 7 ? MIG_UNSUPPORTED : strcmp(fields[6], "on") == 0 ? MIG_ENABLED : MIG_DISABLED;
}

/* Parse one "parent_uuid,slot,uuid,gpu_slices,memory_size_mb,total,free[,compute_slices]" entry;
 * an entry naming no known parent is ignored. */
static void parse_slice(char *entry) {
    char *fields[8] = {0};
    int n = split_fields(entry, fields, 8);
    if (n < 7 || slice_count >= MAX_SLICES) return;
    for (unsigned int i = 0; i < device_count; i++) {
        if (strcmp(devices[i].uuid, fields[0]) != 0) continue;
        fake_slice *s = &slices[slice_count++];
        memset(s, 0, sizeof *s);
        s->parent = i;
        s->slot = (unsigned int)strtoul(fields[1], NULL, 10);
        copy_field(s->uuid, fields[2]);
        s->gpu_slices = (unsigned int)strtoul(fields[3], NULL, 10);
        s->memory_size_mb = strtoull(fields[4], NULL, 10);
        s->total_mb = strtoull(fields[5], NULL, 10);
        s->free_mb = strtoull(fields[6], NULL, 10);
        s->compute_slices = n > 7 ? (unsigned int)strtoul(fields[7], NULL, 10) : s->gpu_slices;
        return;
    }
}

/* Call parse on each non-empty ';'-separated entry of the environment variable name. */
static void parse_list(const char *name, void (*parse)(char *)) {
    const char *spec = getenv(name);
    if (!spec || !*spec) return;
    char *copy = strdup(spec);
    char *save = NULL;
    for (char *entry = strtok_r(copy, ";", &save); entry; entry = strtok_r(NULL, ";", &save)) {
        if (*entry) parse(entry);
    }
    free(copy);
}

static int do_init(void) {
    const char *forced = getenv("FAKE_NVML_INIT_RESULT");
    if (forced && *forced) {
        int code = atoi(forced);
        if (code != NVML_SUCCESS) return code;
    }
    device_count = 0;
    slice_count = 0;
    parse_list("FAKE_NVML_DEVICES", parse_device);
    parse_list("FAKE_NVML_MIG_DEVICES", parse_slice);
    initialised = 1;
    return NVML_SUCCESS;
}

static int put_text(char *buf, unsigned int length, const char *text) {
    if (!buf) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(text) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(buf, text);
    return NVML_SUCCESS;
}

static fake_device *device_of(void *handle) {
    fake_device *d = (fake_device *)handle;
    if (!initialised || d < devices || d >= devices + device_count) return NULL;
    return d;
}

static fake_slice *slice_of(void *handle) {
    fake_slice *s = (fake_slice *)handle;
    if (!initialised || s < slices || s >= slices + slice_count) return NULL;
    return s;
}

int nvmlInitWithFlags(unsigned int flags) { (void)flags; return do_init(); }
int nvmlInit_v2(void) { return do_init(); }
int nvmlInit(void) { return do_init(); }

int nvmlShutdown(void) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    initialised = 0;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(int result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    case 999: return "Unknown Error";
    default: return "Fake NVML error";
    }
}

int nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = device_count;
    return NVML_SUCCESS;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= device_count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

int nvmlDeviceGetUUID(void *handle, char *uuid, unsigned int length) {
    fake_device *d = device_of(handle);
    fake_slice *s = slice_of(handle);
    const char *text = d ? d->uuid : s ? s->uuid : NULL;
    if (!text) return NVML_ERROR_INVALID_ARGUMENT;
    if (strcmp(text, "ERR") == 0) return NVML_ERROR_UNKNOWN;
    return put_text(uuid, length, text);
}

int nvmlDeviceGetName(void *handle, char *name, unsigned int length) {
    fake_device *d = device_of(handle);
    if (!d) return NVML_ERROR_INVALID_ARGUMENT;
    return put_text(name, length, d->name);
}

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

/* The line of FAKE_NVML_USE_FILE naming uuid: 1 with its figures, 0 when there is none. */
static int use_of(const char *uuid, unsigned int *percent, unsigned long long *used_mb) {
    const char *name = getenv("FAKE_NVML_USE_FILE");
    if (!name || !*name) return 0;
    FILE *file = fopen(name, "r");
    if (!file) return 0;
    char line[256];
    int found = 0;
    while (!found && fgets(line, sizeof line, file)) {
        char *fields[3] = {0};
        line[strcspn(line, "\r\n")] = 0;
        if (split_fields(line, fields, 3) < 3 || strcmp(fields[0], uuid) != 0) continue;
        *percent = (unsigned int)strtoul(fields[1], NULL, 10);
        *used_mb = strtoull(fields[2], NULL, 10);
        found = 1;
    }
    fclose(file);
    return found;
}

int nvmlDeviceGetMemoryInfo(void *handle, nvmlMemory_t *memory) {
    fake_device *d = device_of(handle);
    fake_slice *s = slice_of(handle);
    if ((!d && !s) || !memory) return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = (d ? d->total_mb : s->total_mb) * 1024ULL * 1024ULL;
    memory->free = (d ? d->free_mb : s->free_mb) * 1024ULL * 1024ULL;
    unsigned int percent = 0;
    unsigned long long used_mb = 0;
    if (use_of(d ? d->uuid : s->uuid, &percent, &used_mb)) {
        unsigned long long used = used_mb * 1024ULL * 1024ULL;
        memory->free = used < memory->total ? memory->total - used : 0;
    }
    memory->used = memory->total - memory->free;
    return NVML_SUCCESS;
}

int nvmlDeviceGetUtilizationRates(void *handle, nvmlUtilization_t *utilization) {
    fake_device *d = device_of(handle);
    fake_slice *s = slice_of(handle);
    if ((!d && !s) || !utilization) return NVML_ERROR_INVALID_ARGUMENT;
    if (s) return NVML_ERROR_NOT_SUPPORTED;  /* as NVML: a MIG slice reports no utilisation of its own */
    unsigned int percent = 0;
    unsigned long long used_mb = 0;
    use_of(d->uuid, &percent, &used_mb);
    utilization->gpu = percent;
    utilization->memory = 0;
    return NVML_SUCCESS;
}

int nvmlDeviceGetCudaComputeCapability(void *handle, int *major, int *minor) {
    fake_device *d = device_of(handle);
    if (!d || !major || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    *major = d->major;
    *minor = d->minor;
    return NVML_SUCCESS;
}

int nvmlDeviceGetMigMode(void *handle, unsigned int *current, unsigned int *pending) {
    fake_device *d = device_of(handle);
    if (!d || !current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->mig == MIG_UNSUPPORTED) return NVML_ERROR_NOT_SUPPORTED;
    *current = *pending = d->mig == MIG_ENABLED;
    return NVML_SUCCESS;
}

int nvmlDeviceGetMaxMigDeviceCount(void *handle, unsigned int *count) {
    fake_device *d = device_of(handle);
    if (!d || !count) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->mig == MIG_UNSUPPORTED) return NVML_ERROR_NOT_SUPPORTED;
    *count = MIG_SLOTS;
    return NVML_SUCCESS;
}

int nvmlDeviceGetMigDeviceHandleByIndex(void *handle, unsigned int index, void **mig) {
    fake_device *d = device_of(handle);
    if (!d || !mig || index >= MIG_SLOTS) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->mig == MIG_UNSUPPORTED) return NVML_ERROR_NOT_SUPPORTED;
    for (unsigned int i = 0; i < slice_count; i++) {
        if (&devices[slices[i].parent] == d && slices[i].slot == index) {
            *mig = &slices[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* Defined for MIG device handles only, as the slice counts and memory size describe a MIG device. */
int nvmlDeviceGetAttributes_v2(void *handle, nvmlDeviceAttributes_t *attributes) {
    fake_slice *s = slice_of(handle);
    if (!attributes) return NVML_ERROR_INVALID_ARGUMENT;
    if (!s) return device_of(handle) ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
    memset(attributes, 0, sizeof *attributes);
    attributes->gpuInstanceSliceCount = s->gpu_slices;
    attributes->computeInstanceSliceCount = s->compute_slices;
    attributes->memorySizeMB = s->memory_size_mb;
    return NVML_SUCCESS;
}

int nvmlSystemGetCudaDriverVersion(int *version) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    *version = 12040;
    return NVML_SUCCESS;
}

int nvmlSystemGetCudaDriverVersion_v2(int *version) { return nvmlSystemGetCudaDriverVersion(version); }

int nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    return put_text(version, length, "550.54.15");
}
