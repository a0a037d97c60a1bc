// kvblend CLI: one function per sub-command; argv[0] is the sub-command name.
#pragma once

namespace kvblend::cli {

int cmd_generate(int argc, char ** argv);
int cmd_make_model(int argc, char ** argv);
int cmd_bench(int argc, char ** argv);
int cmd_blend(int argc, char ** argv);
int cmd_ingest(int argc, char ** argv);
int cmd_store(int argc, char ** argv);
int cmd_serve(int argc, char ** argv);
int cmd_calibrate(int argc, char ** argv);

}  // namespace kvblend::cli
