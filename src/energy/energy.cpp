// kvblend energy meter: powercap/RAPL zones and NVML devices read as
// microjoule counters; a span is the sum of their advances between two marks.
#include "kvblend/energy.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace kvblend {

struct energy_meter::domain {
    std::string name;
    uint64_t max_range_uj = 0;  // the counter wraps to 0 after this; 0: it never wraps
    virtual ~domain() = default;
    // the counter now, in microjoules; false with err set when it cannot be read
    virtual bool read(uint64_t & uj, std::string & err) const = 0;
};

energy_meter_params energy_meter_default_params() {
    return energy_meter_params{};
}

bool energy_counter_delta(uint64_t from, uint64_t to, uint64_t max_range_uj, uint64_t & delta_uj) {
    if (max_range_uj == 0) {
        if (to < from) return false;
        delta_uj = to - from;
        return true;
    }
    if (from > max_range_uj || to > max_range_uj) return false;
    // one wrap at most: a span longer than a whole range (minutes at full
    // power for the usual 262 kJ package range) cannot be told from a shorter one
    delta_uj = to >= from ? to - from : (max_range_uj - from) + to;
    return true;
}

energy_span energy_span_sum(const energy_span & a, const energy_span & b) {
    energy_span s;
    if (!a.ok || !b.ok || a.domain_joules.size() != b.domain_joules.size()) {
        s.why_not = !a.ok ? a.why_not : !b.ok ? b.why_not : "spans of different meters";
        return s;
    }
    s.ok = true;
    s.joules = a.joules + b.joules;
    for (size_t i = 0; i < a.domain_joules.size(); ++i)
        s.domain_joules.push_back(a.domain_joules[i] + b.domain_joules[i]);
    return s;
}

namespace {

// a sysfs counter file: one unsigned decimal number and a newline
bool read_count_file(const std::string & path, uint64_t & value, std::string & err) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        err = path + " is not readable: " + std::strerror(errno);
        if (errno == EACCES) err += " (Linux 5.10 and later let only root read RAPL counters)";
        return false;
    }
    char buf[64];
    ssize_t n;
    do n = read(fd, buf, sizeof buf - 1);
    while (n < 0 && errno == EINTR);
    const int read_errno = errno;
    close(fd);
    if (n < 0) {
        err = path + " cannot be read: " + std::strerror(read_errno);
        return false;
    }
    size_t len = (size_t) n;
    while (len > 0 && (buf[len - 1] == '\n' || buf[len - 1] == ' ')) --len;
    buf[len] = '\0';
    uint64_t v = 0;
    bool digits = len > 0;
    for (size_t i = 0; i < len && digits; ++i) {
        const unsigned d = (unsigned) (buf[i] - '0');
        if (d > 9 || v > (UINT64_MAX - d) / 10) digits = false;
        v = v * 10 + d;
    }
    if (!digits) {
        err = path + " holds '" + std::string(buf, std::min<size_t>(len, 24)) + "', not a count of microjoules";
        return false;
    }
    value = v;
    return true;
}

struct rapl_domain : energy_meter::domain {
    std::string energy_path;
    bool read(uint64_t & uj, std::string & err) const override { return read_count_file(energy_path, uj, err); }
};

std::string first_line(const std::string & path) {
    std::string s;
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return s;
    char buf[128];
    const ssize_t n = read(fd, buf, sizeof buf);
    close(fd);
    if (n > 0) s.assign(buf, (size_t) n);
    return s.substr(0, s.find('\n'));
}

// the package and dram zones: the others (core, uncore) are parts of the
// package, psys spans the whole platform, and intel-rapl-mmio repeats the
// package counter through another interface; any of them would count twice
bool rapl_zone_counted(const std::string & dir_name, const std::string & zone_name) {
    if (dir_name.find("mmio") != std::string::npos) return false;
    return zone_name.rfind("package-", 0) == 0 || zone_name == "dram";
}

std::unique_ptr<rapl_domain> rapl_open_zone(const std::string & zone_dir, const std::string & dir_name,
                                            const std::string & zone_name, std::string & err) {
    auto d = std::make_unique<rapl_domain>();
    d->name = "rapl " + dir_name + " " + zone_name;
    d->energy_path = zone_dir + "/energy_uj";
    if (!read_count_file(zone_dir + "/max_energy_range_uj", d->max_range_uj, err)) {
        err += " (without the range a wrap of the counter cannot be told apart)";
        return nullptr;
    }
    if (d->max_range_uj == 0) {
        err = zone_dir + "/max_energy_range_uj is 0";
        return nullptr;
    }
    uint64_t now = 0;
    if (!d->read(now, err)) return nullptr;
    if (now > d->max_range_uj) {
        err = d->energy_path + " reads above its range of " + std::to_string(d->max_range_uj) + " uJ";
        return nullptr;
    }
    return d;
}

std::vector<std::string> sorted_entries(const std::string & dir) {
    std::vector<std::string> names;
    DIR * d = opendir(dir.c_str());
    if (!d) return names;
    while (const dirent * e = readdir(d))
        if (e->d_name[0] != '.') names.emplace_back(e->d_name);
    closedir(d);
    std::sort(names.begin(), names.end());
    return names;
}

}  // namespace

// --- NVML, opened at run time: a machine without NVIDIA's driver has no
// libnvidia-ml.so.1, and kvblend must still start there --------------------
struct energy_meter::nvml_lib {
    using nvml_device = void *;  // nvmlDevice_t
    void * handle = nullptr;
    int (*init)() = nullptr;
    int (*shutdown)() = nullptr;
    int (*count)(unsigned *) = nullptr;
    int (*by_index)(unsigned, nvml_device *) = nullptr;
    int (*energy)(nvml_device, unsigned long long *) = nullptr;  // millijoules since the driver loaded
    int (*name)(nvml_device, char *, unsigned) = nullptr;
    const char * (*error_string)(int) = nullptr;
    bool initialized = false;

    ~nvml_lib() {
        if (initialized) shutdown();
        if (handle) dlclose(handle);
    }
    std::string describe(int rc) const {
        const char * s = error_string ? error_string(rc) : nullptr;
        return s ? std::string(s) + " (" + std::to_string(rc) + ")" : "error " + std::to_string(rc);
    }
};

namespace {

struct nvml_domain : energy_meter::domain {
    const energy_meter::nvml_lib * lib = nullptr;
    void * device = nullptr;
    bool read(uint64_t & uj, std::string & err) const override {
        unsigned long long mj = 0;
        const int rc = lib->energy(device, &mj);
        if (rc != 0) {
            err = "nvmlDeviceGetTotalEnergyConsumption(" + name + "): " + lib->describe(rc);
            return false;
        }
        uj = (uint64_t) mj * 1000;
        return true;
    }
};

template <typename F>
bool nvml_symbol(void * handle, const char * sym, F & fn, const std::string & lib, std::string & err) {
    fn = reinterpret_cast<F>(dlsym(handle, sym));
    if (!fn) err = lib + " has no " + sym;
    return fn != nullptr;
}

}  // namespace

energy_meter::energy_meter(const energy_meter_params & params) {
    std::vector<std::string> absent;  // one reason per source that gave no counter
    // KVBLEND_POWERCAP_DIR: another powercap tree (tests give a fake one)
    std::string pc = params.powercap_dir;
    if (pc.empty() && std::getenv("KVBLEND_POWERCAP_DIR")) pc = std::getenv("KVBLEND_POWERCAP_DIR");
    if (pc.empty()) pc = "/sys/class/powercap";
    if (params.use_rapl) {
        const size_t before = domains_.size();
        const std::vector<std::string> zones = sorted_entries(pc);
        for (const std::string & z : zones) {
            const std::string zone_name = first_line(pc + "/" + z + "/name");
            if (!rapl_zone_counted(z, zone_name)) continue;
            std::string err;
            if (auto d = rapl_open_zone(pc + "/" + z, z, zone_name, err))
                domains_.push_back(std::move(d));
            else
                skipped_.push_back("rapl " + z + " " + zone_name + ": " + err);
        }
        if (domains_.size() == before)
            absent.push_back(zones.empty()      ? "no powercap/RAPL zones in " + pc + " (not exposed on this machine)"
                             : skipped_.empty() ? "no package or dram zone in " + pc
                                                : "no powercap/RAPL zone readable: " + skipped_.front());
    }
    if (params.use_nvml) {
        std::string err = open_nvml(params.nvml_lib);
        if (!err.empty()) absent.push_back(err);
    }
    if (!params.use_rapl && !params.use_nvml) absent.push_back("every counter source is switched off");
    if (domains_.empty())
        for (const std::string & a : absent) why_absent_ += (why_absent_.empty() ? "" : "; ") + a;
}

energy_meter::~energy_meter() = default;

std::string energy_meter::open_nvml(const std::string & lib_param) {
    // KVBLEND_NVML_LIB: another NVML library (tests give a fake one)
    std::string lib = lib_param;
    if (lib.empty() && std::getenv("KVBLEND_NVML_LIB")) lib = std::getenv("KVBLEND_NVML_LIB");
    if (lib.empty()) lib = "libnvidia-ml.so.1";
    auto nv = std::make_unique<nvml_lib>();
    nv->handle = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!nv->handle) {
        const char * e = dlerror();
        return "no NVML: " + (e ? std::string(e) : lib + " cannot be opened");
    }
    std::string err;
    if (!nvml_symbol(nv->handle, "nvmlInit_v2", nv->init, lib, err) ||
        !nvml_symbol(nv->handle, "nvmlShutdown", nv->shutdown, lib, err) ||
        !nvml_symbol(nv->handle, "nvmlDeviceGetCount_v2", nv->count, lib, err) ||
        !nvml_symbol(nv->handle, "nvmlDeviceGetHandleByIndex_v2", nv->by_index, lib, err) ||
        !nvml_symbol(nv->handle, "nvmlDeviceGetTotalEnergyConsumption", nv->energy, lib, err))
        return "no NVML: " + err;
    nvml_symbol(nv->handle, "nvmlDeviceGetName", nv->name, lib, err);        // optional
    nvml_symbol(nv->handle, "nvmlErrorString", nv->error_string, lib, err);  // optional
    if (const int rc = nv->init(); rc != 0) return "no NVML: nvmlInit_v2: " + nv->describe(rc);
    nv->initialized = true;
    unsigned n = 0;
    if (const int rc = nv->count(&n); rc != 0) return "no NVML: nvmlDeviceGetCount_v2: " + nv->describe(rc);
    const size_t before = domains_.size();
    for (unsigned i = 0; i < n; ++i) add_nvml_device(*nv, i);
    if (domains_.size() == before)
        return n == 0 ? "NVML sees no GPU" : "no GPU energy counter readable through NVML: " + skipped_.back();
    nvml_ = std::move(nv);
    return "";
}

void energy_meter::add_nvml_device(const nvml_lib & nv, unsigned index) {
    auto d = std::make_unique<nvml_domain>();
    d->lib = &nv;
    d->name = "nvml " + std::to_string(index);
    if (const int rc = nv.by_index(index, &d->device); rc != 0) {
        skipped_.push_back(d->name + ": nvmlDeviceGetHandleByIndex_v2: " + nv.describe(rc));
        return;
    }
    char gpu_name[96] = {0};
    if (nv.name && nv.name(d->device, gpu_name, sizeof gpu_name) == 0) d->name += std::string(" ") + gpu_name;
    uint64_t now = 0;
    std::string err;
    if (!d->read(now, err)) {  // before Volta GPUs have no energy counter
        skipped_.push_back(err);
        return;
    }
    domains_.push_back(std::move(d));
}

std::vector<std::string> energy_meter::domains() const {
    std::vector<std::string> names;
    for (const auto & d : domains_) names.push_back(d->name);
    return names;
}

energy_mark energy_meter::mark() const {
    energy_mark m;
    m.uj.resize(domains_.size());
    for (size_t i = 0; i < domains_.size() && m.error.empty(); ++i)
        if (!domains_[i]->read(m.uj[i], m.error)) m.uj.clear();
    return m;
}

energy_span energy_meter::span(const energy_mark & from, const energy_mark & to) const {
    energy_span s;
    if (domains_.empty()) {
        s.why_not = why_absent_;
        return s;
    }
    if (!from.error.empty() || !to.error.empty()) {
        s.why_not = !from.error.empty() ? from.error : to.error;
        return s;
    }
    if (from.uj.size() != domains_.size() || to.uj.size() != domains_.size()) {
        s.why_not = "marks taken by another meter";
        return s;
    }
    uint64_t total_uj = 0;
    for (size_t i = 0; i < domains_.size(); ++i) {
        uint64_t d = 0;
        if (!energy_counter_delta(from.uj[i], to.uj[i], domains_[i]->max_range_uj, d)) {
            s.why_not = domains_[i]->name + " went from " + std::to_string(from.uj[i]) + " to " +
                        std::to_string(to.uj[i]) + " uJ, which no wrap of its counter explains";
            s.domain_joules.clear();
            return s;
        }
        s.domain_joules.push_back(d * 1e-6);
        total_uj += d;
    }
    if (total_uj == 0) {
        s.domain_joules.clear();
        s.why_not = "no counter moved (an interval shorter than their update period)";
        return s;
    }
    s.ok = true;
    s.joules = total_uj * 1e-6;
    return s;
}

}  // namespace kvblend
