/* a stand-in for libnvidia-ml.so.1 that the energy tests open instead: every
 * call reads the file named by $FAKE_NVML_STATE, lines of
 *   init RC            what nvmlInit_v2 returns (0: success)
 *   count N            the GPUs nvmlDeviceGetCount_v2 reports
 *   energy I MJ        GPU I's energy counter in millijoules
 *   energy_rc I RC     GPU I's counter read fails with RC (3: not supported)
 *   watts I W          GPU I draws W watts: its counter grows by W joules a second of
 *                      CLOCK_MONOTONIC, counted in microseconds (so a run through
 *                      the CLI gets spans that grow with its time)
 * so a test changes the counters between two marks by rewriting the file. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define FAKE_MAX_GPUS 8

struct fake_state {
    int init_rc;
    unsigned count;
    unsigned long long energy_mj[FAKE_MAX_GPUS];
    int energy_rc[FAKE_MAX_GPUS];
    unsigned watts[FAKE_MAX_GPUS];
};

static struct fake_state load(void) {
    struct fake_state s;
    memset(&s, 0, sizeof s);
    const char * path = getenv("FAKE_NVML_STATE");
    FILE * f = path ? fopen(path, "r") : NULL;
    if (!f) {
        s.init_rc = 999; /* NVML_ERROR_UNKNOWN */
        return s;
    }
    char key[32];
    while (fscanf(f, "%31s", key) == 1) {
        unsigned i = 0;
        if (!strcmp(key, "init"))
            fscanf(f, "%d", &s.init_rc);
        else if (!strcmp(key, "count"))
            fscanf(f, "%u", &s.count);
        else if (!strcmp(key, "energy") && fscanf(f, "%u", &i) == 1 && i < FAKE_MAX_GPUS)
            fscanf(f, "%llu", &s.energy_mj[i]);
        else if (!strcmp(key, "energy_rc") && fscanf(f, "%u", &i) == 1 && i < FAKE_MAX_GPUS)
            fscanf(f, "%d", &s.energy_rc[i]);
        else if (!strcmp(key, "watts") && fscanf(f, "%u", &i) == 1 && i < FAKE_MAX_GPUS)
            fscanf(f, "%u", &s.watts[i]);
    }
    fclose(f);
    return s;
}

int nvmlInit_v2(void) {
    return load().init_rc;
}
int nvmlShutdown(void) {
    return 0;
}

int nvmlDeviceGetCount_v2(unsigned * n) {
    *n = load().count;
    return 0;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned i, void ** dev) {
    if (i >= load().count) return 2; /* NVML_ERROR_INVALID_ARGUMENT */
    *dev = (void *) (size_t) (i + 1);
    return 0;
}

int nvmlDeviceGetName(void * dev, char * name, unsigned len) {
    snprintf(name, len, "Fake GPU %u", (unsigned) ((size_t) dev - 1));
    return 0;
}

int nvmlDeviceGetTotalEnergyConsumption(void * dev, unsigned long long * mj) {
    const struct fake_state s = load();
    const unsigned i = (unsigned) ((size_t) dev - 1);
    if (i >= FAKE_MAX_GPUS) return 2;
    if (s.energy_rc[i]) return s.energy_rc[i];
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    const unsigned long long us =
        (unsigned long long) now.tv_sec * 1000000ull + (unsigned long long) now.tv_nsec / 1000ull;
    *mj = s.energy_mj[i] + (unsigned long long) s.watts[i] * us / 1000ull;
    return 0;
}

const char * nvmlErrorString(int rc) {
    return rc == 3 ? "Not Supported" : "Fake Error";
}
