/*
 * A stand-in for libnvidia-ml.so.1: the NVML entry points pynvml calls for inventory detection.
 *
 * Devices come from FAKE_NVML_DEVICES, ';'-separated, each "uuid,name,total_mb,free_mb,cc_major,cc_minor":
 *   FAKE_NVML_DEVICES="GPU-aaa,NVIDIA A100,40960,40000,8,0;GPU-bbb,Tesla T4,16384,16000,7,5"
 * FAKE_NVML_INIT_RESULT=<int> makes nvmlInit* return that NVML error code (9 = DRIVER_NOT_LOADED).
 * A device whose uuid is "ERR" makes nvmlDeviceGetUUID return 999 (NVML_ERROR_UNKNOWN).
 *
 * Build: gcc -shared -fPIC -o libnvidia-ml.so.1 fake_nvml.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_UNKNOWN 999

#define MAX_DEVICES 16
#define TEXT 96

typedef struct {
    char uuid[TEXT];
    char name[TEXT];
    unsigned long long total_mb;
    unsigned long long free_mb;
    int major;
    int minor;
} fake_device;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

static fake_device devices[MAX_DEVICES];
static unsigned int device_count = 0;
static int initialised = 0;

static void copy_field(char *dst, const char *src) {
    while (*src == ' ') src++;
    snprintf(dst, TEXT, "%s", src);
}

/* Parse one "uuid,name,total,free,major,minor" entry into devices[device_count]. */
static void parse_device(char *entry) {
    char *fields[6] = {0};
    int n = 0;
    char *save = NULL;
    for (char *tok = strtok_r(entry, ",", &save); tok && n < 6; tok = strtok_r(NULL, ",", &save)) {
        fields[n++] = tok;
    }
    if (n < 1 || device_count >= MAX_DEVICES) return;
    fake_device *d = &devices[device_count++];
    memset(d, 0, sizeof *d);
    copy_field(d->uuid, fields[0]);
    copy_field(d->name, n > 1 ? fields[1] : "Fake GPU");
    d->total_mb = n > 2 ? strtoull(fields[2], NULL, 10) : 0;
    d->free_mb = n > 3 ? strtoull(fields[3], NULL, 10) : 0;
    d->major = n > 4 ? atoi(fields[4]) : 0;
    d->minor = n > 5 ? atoi(fields[5]) : 0;
}

static int do_init(void) {
    const char *forced = getenv("FAKE_NVML_INIT_RESULT");
    if (forced && *forced) {
        int code = atoi(forced);
        if (code != NVML_SUCCESS) return code;
    }
    device_count = 0;
    const char *spec = getenv("FAKE_NVML_DEVICES");
    if (spec && *spec) {
        char *copy = strdup(spec);
        char *save = NULL;
        for (char *entry = strtok_r(copy, ";", &save); entry; entry = strtok_r(NULL, ";", &save)) {
            if (*entry) parse_device(entry);
        }
        free(copy);
    }
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
    if (!d) return NVML_ERROR_INVALID_ARGUMENT;
    if (strcmp(d->uuid, "ERR") == 0) return NVML_ERROR_UNKNOWN;
    return put_text(uuid, length, d->uuid);
}

int nvmlDeviceGetName(void *handle, char *name, unsigned int length) {
    fake_device *d = device_of(handle);
    if (!d) return NVML_ERROR_INVALID_ARGUMENT;
    return put_text(name, length, d->name);
}

int nvmlDeviceGetMemoryInfo(void *handle, nvmlMemory_t *memory) {
    fake_device *d = device_of(handle);
    if (!d || !memory) return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = d->total_mb * 1024ULL * 1024ULL;
    memory->free = d->free_mb * 1024ULL * 1024ULL;
    memory->used = memory->total - memory->free;
    return NVML_SUCCESS;
}

int nvmlDeviceGetCudaComputeCapability(void *handle, int *major, int *minor) {
    fake_device *d = device_of(handle);
    if (!d || !major || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    *major = d->major;
    *minor = d->minor;
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
