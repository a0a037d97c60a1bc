// the energy meter on counters the tests control: a fake powercap tree (zones,
// wrap-around, missing, unreadable and garbled files) and a fake NVML library;
// bad readings are absences with a reason, never negative joules.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "kvblend/energy.h"
#include "test_util.h"

namespace kvblend {
namespace {

namespace fs = std::filesystem;

bool has(const std::string & text, const std::string & part) {
    return text.find(part) != std::string::npos;
}

// a folder laid out as /sys/class/powercap: one folder per zone with name,
// energy_uj and max_energy_range_uj
struct fake_powercap {
    test::temp_dir dir{"powercap"};

    void write(const std::string & zone, const std::string & file, const std::string & text) const {
        fs::create_directories(dir.path() / zone);
        std::ofstream(dir.path() / zone / file) << text;
    }
    void zone(const std::string & zone, const std::string & name, uint64_t uj,
              uint64_t max_range = 262143328850ull) const {
        write(zone, "name", name + "\n");
        write(zone, "energy_uj", std::to_string(uj) + "\n");
        write(zone, "max_energy_range_uj", std::to_string(max_range) + "\n");
    }
    void set(const std::string & zone, uint64_t uj) const { write(zone, "energy_uj", std::to_string(uj) + "\n"); }
    energy_meter_params params() const {
        energy_meter_params p;
        p.powercap_dir = dir.path().string();
        p.use_nvml = false;
        return p;
    }
};

// the fake NVML's state file (tests/energy/fake_nvml.c), named by $FAKE_NVML_STATE
struct fake_nvml {
    test::temp_dir dir{"nvml"};
    fake_nvml() { setenv("FAKE_NVML_STATE", dir.file("state").c_str(), 1); }
    ~fake_nvml() { unsetenv("FAKE_NVML_STATE"); }
    void state(const std::string & text) const { std::ofstream(dir.file("state")) << text; }
    static energy_meter_params params() {
        energy_meter_params p;
        p.nvml_lib = KVBLEND_FAKE_NVML;
        p.use_rapl = false;
        return p;
    }
};

TEST(energy, counter_delta_takes_one_wrap_and_refuses_the_impossible) {
    uint64_t d = 0;
    ASSERT_TRUE(energy_counter_delta(100, 350, 1000, d));
    EXPECT_EQ(d, 250u);
    ASSERT_TRUE(energy_counter_delta(900, 100, 1000, d));  // wrapped past 1000 to 0
    EXPECT_EQ(d, 200u);
    EXPECT_FALSE(energy_counter_delta(100, 1001, 1000, d));  // above its range
    EXPECT_FALSE(energy_counter_delta(1001, 5, 1000, d));
    ASSERT_TRUE(energy_counter_delta(7, 7, 0, d));  // a counter that never wraps
    EXPECT_EQ(d, 0u);
    EXPECT_FALSE(energy_counter_delta(8, 7, 0, d));  // ... cannot go backwards
}

TEST(energy, rapl_sums_package_and_dram_and_leaves_out_their_parts) {
    fake_powercap pc;
    pc.zone("intel-rapl:0", "package-0", 1000000);
    pc.zone("intel-rapl:0:0", "core", 500);              // inside the package
    pc.zone("intel-rapl:0:1", "dram", 2000000);          // beside it
    pc.zone("intel-rapl-mmio:0", "package-0", 1000000);  // the package again, over MMIO
    pc.zone("intel-rapl:1", "psys", 99);                 // the whole platform
    const energy_meter meter(pc.params());
    ASSERT_TRUE(meter.available()) << meter.why_absent();
    EXPECT_EQ(meter.domains(), (std::vector<std::string>{"rapl intel-rapl:0 package-0", "rapl intel-rapl:0:1 dram"}));
    const energy_mark a = meter.mark();
    pc.set("intel-rapl:0", 6000000);    // +5 J
    pc.set("intel-rapl:0:0", 900000);   // a part of the package: not added again
    pc.set("intel-rapl:0:1", 3250000);  // +1.25 J
    pc.set("intel-rapl-mmio:0", 6000000);
    const energy_span s = meter.span(a, meter.mark());
    ASSERT_TRUE(s.ok) << s.why_not;
    EXPECT_DOUBLE_EQ(s.joules, 6.25);
    EXPECT_EQ(s.domain_joules, (std::vector<double>{5.0, 1.25}));
}

TEST(energy, rapl_counter_that_wraps_counts_across_the_wrap) {
    fake_powercap pc;
    pc.zone("intel-rapl:0", "package-0", 900000, 1000000);  // wraps after 1 J
    const energy_meter meter(pc.params());
    const energy_mark a = meter.mark();
    pc.set("intel-rapl:0", 150000);
    const energy_span s = meter.span(a, meter.mark());
    ASSERT_TRUE(s.ok) << s.why_not;
    EXPECT_DOUBLE_EQ(s.joules, 0.25);
}

TEST(energy, rapl_reading_above_its_range_is_an_absence_not_negative) {
    fake_powercap pc;
    pc.zone("intel-rapl:0", "package-0", 900000, 1000000);
    const energy_meter meter(pc.params());
    const energy_mark a = meter.mark();
    pc.set("intel-rapl:0", 1000001);
    const energy_span s = meter.span(a, meter.mark());
    EXPECT_FALSE(s.ok);
    EXPECT_EQ(s.joules, 0.0);
    EXPECT_TRUE(has(s.why_not, "no wrap of its counter explains")) << s.why_not;
}

TEST(energy, rapl_zone_without_a_range_or_a_counter_is_left_out_with_the_reason) {
    fake_powercap pc;
    pc.zone("intel-rapl:0", "package-0", 1000);
    pc.zone("intel-rapl:1", "package-1", 1000);
    fs::remove(pc.dir.path() / "intel-rapl:1" / "max_energy_range_uj");
    pc.zone("intel-rapl:2", "package-2", 1000);
    fs::remove(pc.dir.path() / "intel-rapl:2" / "energy_uj");
    const energy_meter meter(pc.params());
    EXPECT_EQ(meter.domains(), std::vector<std::string>{"rapl intel-rapl:0 package-0"});
    ASSERT_EQ(meter.skipped().size(), 2u);
    EXPECT_TRUE(has(meter.skipped()[0], "intel-rapl:1/max_energy_range_uj is not readable")) << meter.skipped()[0];
    EXPECT_TRUE(has(meter.skipped()[0], "wrap")) << meter.skipped()[0];
    EXPECT_TRUE(has(meter.skipped()[1], "intel-rapl:2/energy_uj is not readable: No such file")) << meter.skipped()[1];
}

TEST(energy, rapl_counter_that_is_not_a_number_is_refused) {
    for (const char * bad : {"abc\n", "\n", "-5\n", "12x\n", "99999999999999999999999\n"}) {
        fake_powercap pc;
        pc.zone("intel-rapl:0", "package-0", 1000);
        pc.write("intel-rapl:0", "energy_uj", bad);
        const energy_meter meter(pc.params());
        EXPECT_FALSE(meter.available()) << bad;
        EXPECT_TRUE(has(meter.why_absent(), "not a count of microjoules")) << meter.why_absent();
        const energy_span s = meter.span(meter.mark(), meter.mark());
        EXPECT_FALSE(s.ok);
        EXPECT_EQ(s.why_not, meter.why_absent());
    }
}

TEST(energy, rapl_counter_garbled_between_marks_makes_the_span_absent) {
    fake_powercap pc;
    pc.zone("intel-rapl:0", "package-0", 1000);
    const energy_meter meter(pc.params());
    const energy_mark a = meter.mark();
    pc.write("intel-rapl:0", "energy_uj", "garbage\n");
    const energy_mark b = meter.mark();
    EXPECT_TRUE(has(b.error, "holds 'garbage'")) << b.error;
    const energy_span s = meter.span(a, b);
    EXPECT_FALSE(s.ok);
    EXPECT_TRUE(s.domain_joules.empty());
    EXPECT_EQ(s.why_not, b.error);
}

TEST(energy, rapl_counter_that_cannot_be_read_is_left_out) {
    fake_powercap pc;
    pc.zone("intel-rapl:0", "package-0", 1000);
    fs::remove(pc.dir.path() / "intel-rapl:0" / "energy_uj");
    fs::create_directories(pc.dir.path() / "intel-rapl:0" / "energy_uj");  // opens, but reads fail
    const energy_meter meter(pc.params());
    EXPECT_FALSE(meter.available());
    EXPECT_TRUE(has(meter.why_absent(), "energy_uj cannot be read: Is a directory")) << meter.why_absent();
}

TEST(energy, no_powercap_tree_is_an_absence_with_the_reason) {
    energy_meter_params p;
    p.powercap_dir = "/nonexistent/powercap";
    p.use_nvml = false;
    const energy_meter meter(p);
    EXPECT_FALSE(meter.available());
    EXPECT_TRUE(has(meter.why_absent(), "no powercap/RAPL zones in /nonexistent/powercap")) << meter.why_absent();
    fake_powercap empty_of_zones;
    empty_of_zones.zone("intel-rapl:0:0", "core", 1000);
    const energy_meter cores_only(empty_of_zones.params());
    EXPECT_TRUE(has(cores_only.why_absent(), "no package or dram zone")) << cores_only.why_absent();
}

TEST(energy, counters_that_did_not_move_give_no_figure) {
    fake_powercap pc;
    pc.zone("intel-rapl:0", "package-0", 1000);
    const energy_meter meter(pc.params());
    const energy_span s = meter.span(meter.mark(), meter.mark());
    EXPECT_FALSE(s.ok);
    EXPECT_TRUE(has(s.why_not, "no counter moved")) << s.why_not;
}

TEST(energy, powercap_dir_comes_from_the_environment) {
    fake_powercap pc;
    pc.zone("intel-rapl:0", "package-0", 1000);
    setenv("KVBLEND_POWERCAP_DIR", pc.dir.path().c_str(), 1);
    energy_meter_params p;
    p.use_nvml = false;
    const energy_meter meter(p);
    unsetenv("KVBLEND_POWERCAP_DIR");
    EXPECT_EQ(meter.domains(), std::vector<std::string>{"rapl intel-rapl:0 package-0"});
}

TEST(energy, nvml_absent_is_an_absence_with_the_reason) {
    energy_meter_params p;
    p.use_rapl = false;
    p.nvml_lib = "/nonexistent/libnvidia-ml.so.1";
    const energy_meter missing(p);
    EXPECT_FALSE(missing.available());
    EXPECT_TRUE(has(missing.why_absent(), "no NVML: /nonexistent/libnvidia-ml.so.1")) << missing.why_absent();
    p.nvml_lib = "libm.so.6";  // a library, but not NVML
    const energy_meter not_nvml(p);
    EXPECT_TRUE(has(not_nvml.why_absent(), "libm.so.6 has no nvmlInit_v2")) << not_nvml.why_absent();
}

TEST(energy, nvml_sums_the_gpus_energy_counters) {
    fake_nvml nv;
    nv.state("init 0\ncount 2\nenergy 0 1000\nenergy 1 5000\n");
    const energy_meter meter(fake_nvml::params());
    ASSERT_TRUE(meter.available()) << meter.why_absent();
    EXPECT_EQ(meter.domains(), (std::vector<std::string>{"nvml 0 Fake GPU 0", "nvml 1 Fake GPU 1"}));
    const energy_mark a = meter.mark();
    nv.state("init 0\ncount 2\nenergy 0 1500\nenergy 1 5250\n");  // millijoules
    const energy_span s = meter.span(a, meter.mark());
    ASSERT_TRUE(s.ok) << s.why_not;
    EXPECT_DOUBLE_EQ(s.joules, 0.75);
    EXPECT_EQ(s.domain_joules, (std::vector<double>{0.5, 0.25}));
}

TEST(energy, nvml_counter_going_backwards_is_an_absence) {
    fake_nvml nv;
    nv.state("init 0\ncount 1\nenergy 0 9000\n");
    const energy_meter meter(fake_nvml::params());
    const energy_mark a = meter.mark();
    nv.state("init 0\ncount 1\nenergy 0 100\n");  // the driver reloaded
    const energy_span s = meter.span(a, meter.mark());
    EXPECT_FALSE(s.ok);
    EXPECT_TRUE(has(s.why_not, "nvml 0 Fake GPU 0 went from 9000000 to 100000 uJ")) << s.why_not;
}

TEST(energy, nvml_gpu_without_a_counter_is_left_out_and_failures_are_reasons) {
    fake_nvml nv;
    nv.state("init 0\ncount 2\nenergy 0 10\nenergy_rc 1 3\n");
    const energy_meter one(fake_nvml::params());
    EXPECT_EQ(one.domains(), std::vector<std::string>{"nvml 0 Fake GPU 0"});
    ASSERT_EQ(one.skipped().size(), 1u);
    EXPECT_TRUE(has(one.skipped()[0], "nvml 1 Fake GPU 1): Not Supported (3)")) << one.skipped()[0];

    nv.state("init 0\ncount 1\nenergy_rc 0 3\n");
    const energy_meter none(fake_nvml::params());
    EXPECT_TRUE(has(none.why_absent(), "no GPU energy counter readable through NVML")) << none.why_absent();
    nv.state("init 9\n");
    const energy_meter no_init(fake_nvml::params());
    EXPECT_TRUE(has(no_init.why_absent(), "nvmlInit_v2: Fake Error (9)")) << no_init.why_absent();
    nv.state("init 0\ncount 0\n");
    const energy_meter no_gpu(fake_nvml::params());
    EXPECT_TRUE(has(no_gpu.why_absent(), "NVML sees no GPU")) << no_gpu.why_absent();
}

TEST(energy, gpu_and_cpu_counters_add_up) {
    fake_nvml nv;
    nv.state("init 0\ncount 1\nenergy 0 1000\n");
    fake_powercap pc;
    pc.zone("intel-rapl:0", "package-0", 1000000);
    energy_meter_params p = pc.params();
    p.use_nvml = true;
    p.nvml_lib = KVBLEND_FAKE_NVML;
    const energy_meter meter(p);
    ASSERT_EQ(meter.domains().size(), 2u);
    const energy_mark a = meter.mark();
    nv.state("init 0\ncount 1\nenergy 0 3000\n");
    pc.set("intel-rapl:0", 1500000);
    const energy_span s = meter.span(a, meter.mark());
    ASSERT_TRUE(s.ok) << s.why_not;
    EXPECT_DOUBLE_EQ(s.joules, 2.5);
}

}  // namespace
}  // namespace kvblend
