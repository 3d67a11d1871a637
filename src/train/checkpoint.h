// Checkpoint helpers shared by the Trainer and the CLI.
#pragma once

#include <string>

#include "fusetrain/models/model.h"

namespace fusetrain::train {

/// Loads the model weights of a checkpoint (or any model directory written by
/// save_pretrained) into `model`, strictly by name.
void load_checkpoint_weights(models::Model& model, const std::string& dir);

/// Replaces `final_dir` by `staged_dir` with renames only, so a crash leaves
/// either the old or the new directory complete under the final name.
void commit_directory(const std::string& staged_dir, const std::string& final_dir);

/// Removes what interrupted saves left in `output_dir`: staging directories (".checkpoint-N.tmp-PID") and temporary
/// files ("NAME.tmp-PID") whose process is gone, and "checkpoint-N.old" (put back as checkpoint-N when a save
/// stopped between its two renames). Says on stderr what it removed.
void remove_unfinished_saves(const std::string& output_dir);

/// Test hook: when FUSETRAIN_FAULT_DURING_SAVE names this step, the process
/// exits (status 86) half way through writing the checkpoint, as a kill would.
void maybe_fault_during_save(int64_t step);

}  // namespace fusetrain::train
