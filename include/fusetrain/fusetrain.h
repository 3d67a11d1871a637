// fusetrain's public C++ API in one include.
//
//   ft::ir::Graph graph;  ft::ir::GraphBuilder b(graph);        // 1. build the forward graph
//   auto loss = ...;                                             //    ending in a scalar loss
//   auto grads = ft::autodiff::build_backward(graph, loss, graph.params());  // 2. append backward
//   ft::runtime::ParameterStore params(graph);                   // 3. flat parameter/gradient buffers
//   auto plan = ft::compile::compile_plan(graph, params);        // 4. schedule, kernels, arena
//   ft::optim::AdamW opt(params, {.lr = 1e-3});
//   for (...) { plan->upload_input("x", host); params.zero_grads(); plan->run(); opt.clip_and_step(1.0); }
#pragma once

#include "fusetrain/autodiff/backward.h"
#include "fusetrain/compile/lower.h"
#include "fusetrain/core/cpu.h"
#include "fusetrain/core/dtype.h"
#include "fusetrain/core/error.h"
#include "fusetrain/core/half.h"
#include "fusetrain/core/shape.h"
#include "fusetrain/core/tensor.h"
#include "fusetrain/ir/builder.h"
#include "fusetrain/ir/graph.h"
#include "fusetrain/memory/planner.h"
#include "fusetrain/optim/optimizer.h"
#include "fusetrain/passes/fusion.h"
#include "fusetrain/passes/recompute.h"
#include "fusetrain/runtime/parameters.h"
#include "fusetrain/runtime/plan.h"
#include "fusetrain/train/loss_scaler.h"
