// kvblend tests: what store::log_append and store::log_read promise, checked
// the same way on every backend that keeps logs (dir, redis, a cluster)
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvblend/common.h"
#include "kvblend/store.h"

namespace kvblend::test {

inline void check_log_contract(store & st) {
    using strings = std::vector<std::string>;
    std::string cur;
    EXPECT_TRUE(st.log_read("t1", cur, 10).empty());  // nothing written yet
    for (int i = 0; i < 5; ++i) st.log_append("t1", "r" + std::to_string(i), 100);
    EXPECT_EQ(st.log_read("t1", cur, 3), (strings{"r0", "r1", "r2"}));
    EXPECT_EQ(st.log_read("t1", cur, 3), (strings{"r3", "r4"}));
    EXPECT_TRUE(st.log_read("t1", cur, 3).empty());
    st.log_append("t1", "r5", 100);
    EXPECT_EQ(st.log_read("t1", cur, 3), (strings{"r5"}));
    std::string from_start;
    EXPECT_EQ(st.log_read("t1", from_start, 100).size(), 6u);

    // any bytes, an empty record, the largest one
    const std::string bin("\0\x01\xff\n", 4), big(store::k_max_log_record, 'x');
    for (const std::string & r : {bin, std::string(), big}) st.log_append("t2", r, 10);
    std::string c2;
    EXPECT_EQ(st.log_read("t2", c2, 10), (strings{bin, "", big}));

    // bounded: at least the newest max_records are kept, in order, the newest last
    for (int i = 0; i < 50; ++i) st.log_append("t3", std::to_string(i), 5);
    std::string c3;
    const strings kept = st.log_read("t3", c3, 1000);
    ASSERT_GE(kept.size(), 5u);
    EXPECT_LE(kept.size(), 10u);
    for (size_t i = 0; i < kept.size(); ++i) EXPECT_EQ(kept[i], std::to_string(50 - kept.size() + i));

    for (const std::string & name : strings{"", "Docs", "a/b", "../x", std::string(65, 'a')}) {
        try {
            st.log_append(name, "r", 10);
            ADD_FAILURE() << "log name '" << name << "' taken";
        } catch (const error & e) {
            EXPECT_EQ(e.kind(), error_kind::invalid_argument) << e.what();
        }
    }
    try {
        st.log_append("t4", std::string(store::k_max_log_record + 1, 'x'), 10);
        ADD_FAILURE() << "a record over the bound taken";
    } catch (const error & e) {
        EXPECT_EQ(e.kind(), error_kind::invalid_argument) << e.what();
    }
}

}  // namespace kvblend::test
