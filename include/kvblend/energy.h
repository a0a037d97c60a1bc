// kvblend: the energy a run used between two points, read from the counters
// the machine keeps: NVML's per-GPU energy (CUDA devices; libnvidia-ml.so.1 is
// opened at run time) and Linux powercap/RAPL (CPU package and DRAM zones).
// Where no counter can be read the figure is absent, with the reason: it is
// never estimated from power ratings or times.
//
//   energy_meter meter;                      // probes powercap and NVML once
//   const energy_mark a = meter.mark();
//   ... prefill ...
//   const energy_span s = meter.span(a, meter.mark());
//   if (s.ok) use(s.joules); else report(s.why_not);
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvblend {

struct energy_meter_params {
    // the powercap tree; "" means $KVBLEND_POWERCAP_DIR, else /sys/class/powercap
    std::string powercap_dir;
    // the NVML library to open; "" means $KVBLEND_NVML_LIB, else libnvidia-ml.so.1
    std::string nvml_lib;
    bool use_rapl = true;
    bool use_nvml = true;
};

energy_meter_params energy_meter_default_params();

// every counter's value at one moment, in the meter's domain order
struct energy_mark {
    std::vector<uint64_t> uj;  // microjoules as the counters read
    std::string error;         // a counter could not be read: spans over this mark are absent
};

// the energy used between two marks
struct energy_span {
    bool ok = false;
    double joules = 0;                  // sum over the domains
    std::vector<double> domain_joules;  // joules per domain, in the meter's order
    std::string why_not;                // when !ok: why there is no figure
};

class energy_meter {
  public:
    explicit energy_meter(const energy_meter_params & params = energy_meter_default_params());
    ~energy_meter();
    energy_meter(const energy_meter &) = delete;
    energy_meter & operator=(const energy_meter &) = delete;

    // at least one counter was readable when the meter was made
    bool available() const { return !domains_.empty(); }
    // why there is no counter at all ("" when available)
    const std::string & why_absent() const { return why_absent_; }
    // counters that were found but left out, each with its reason
    const std::vector<std::string> & skipped() const { return skipped_; }
    // the counters summed, e.g. "rapl intel-rapl:0 package-0", "nvml 0 NVIDIA H200"
    std::vector<std::string> domains() const;

    energy_mark mark() const;
    // the energy from `from` to `to`. absent (ok false) without counters, when
    // either mark failed, when a counter went backwards past what a wrap
    // explains, or when no counter moved (an interval shorter than their update
    // period): never negative, never made up
    energy_span span(const energy_mark & from, const energy_mark & to) const;

    // one counter the meter reads, and NVML's entry points (internal: src/energy/)
    struct domain;
    struct nvml_lib;

  private:
    // opens NVML and adds its GPUs; "" or why it gave no counter
    std::string open_nvml(const std::string & lib_param);
    void add_nvml_device(const nvml_lib & nv, unsigned index);

    std::vector<std::unique_ptr<domain>> domains_;
    std::vector<std::string> skipped_;
    std::string why_absent_;
    std::unique_ptr<nvml_lib> nvml_;  // the NVML domains read through it
};

// the energy of two spans together (two phases of one run): absent when either is
energy_span energy_span_sum(const energy_span & a, const energy_span & b);

// the microjoules a counter advanced from `from` to `to`, given the value after
// which it wraps to 0 (max_range_uj, 0 for a counter that never wraps).
// false when the readings cannot come from such a counter (a value above its
// range, or a non-wrapping counter that went backwards)
bool energy_counter_delta(uint64_t from, uint64_t to, uint64_t max_range_uj, uint64_t & delta_uj);

}  // namespace kvblend
