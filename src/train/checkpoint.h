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

/// Test hook: when FUSETRAIN_FAULT_DURING_SAVE names this step, the process
/// exits (status 86) half way through writing the checkpoint, as a kill would.
void maybe_fault_during_save(int64_t step);

}  // namespace fusetrain::train
