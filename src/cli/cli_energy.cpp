// kvblend CLI: --energy figures (joules, tokens per joule) in JSON and tables.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"

namespace kvblend::cli {

const char * k_energy_help =
    R"(  --energy              joules and tokens per joule of each phase, from NVML (GPUs)
                        and powercap/RAPL (CPU package and DRAM); where no counter
                        is readable the figure is absent with the reason
                        ($KVBLEND_POWERCAP_DIR, $KVBLEND_NVML_LIB: other sources)
)";

void energy_series::add(const energy_span & s) {
    if (s.ok)
        joules.push_back(s.joules);
    else if (why_not.empty())
        why_not = s.why_not;
}

bool energy_series::ok() const {
    return why_not.empty() && !joules.empty();
}

void energy_series::put(nlohmann::json & j, const std::string & phase, int64_t n_tokens) const {
    if (!ok()) {
        j[phase + "_j"] = nullptr;
        j[phase + "_energy_absent"] = why_not.empty() ? "not measured" : why_not;
        return;
    }
    const double joules_median = median(joules);
    j[phase + "_j"] = joules_median;
    if (n_tokens > 0) j[phase + "_tok_per_j"] = n_tokens / joules_median;
}

void put_energy(nlohmann::json & j, const std::string & phase, const energy_span & s, int64_t n_tokens) {
    energy_series one;
    one.add(s);
    one.put(j, phase, n_tokens);
}

void put_energy_source(nlohmann::json & j, const energy_meter & meter) {
    if (meter.available())
        j["energy_domains"] = meter.domains();
    else
        j["energy_absent"] = meter.why_absent();
}

std::string energy_cell(const nlohmann::json & row, const std::string & phase, const char * unit) {
    const std::string key = phase + (unit[0] == 'J' ? "_j" : "_tok_per_j");
    if (!row.contains(key) || row[key].is_null()) return "-";
    char s[32];
    std::snprintf(s, sizeof s, "%.3g", row[key].get<double>());
    return s;
}

std::string energy_summary(const nlohmann::json & j, const std::vector<std::string> & phases) {
    std::string out;
    for (const std::string & p : phases) {
        if (!j.contains(p + "_j")) continue;  // a phase this run did not have
        if (j[p + "_j"].is_null()) return "energy absent: " + j[p + "_energy_absent"].get<std::string>();
        char s[96];
        std::snprintf(s, sizeof s, "%s %.3g J", p.c_str(), j[p + "_j"].get<double>());
        out += (out.empty() ? "" : ", ") + std::string(s);
        if (j.contains(p + "_tok_per_j")) out += " (" + energy_cell(j, p, "tok/J") + " tok/J)";
    }
    return out;
}

void print_energy_source(const energy_meter & meter) {
    if (!meter.available()) {
        std::printf("\nenergy: absent: %s\n", meter.why_absent().c_str());
        return;
    }
    std::string names;
    for (const std::string & d : meter.domains()) names += (names.empty() ? "" : ", ") + d;
    std::printf("\nenergy from: %s\n", names.c_str());
    for (const std::string & s : meter.skipped()) std::printf("energy: left out %s\n", s.c_str());
}

}  // namespace kvblend::cli
