// The Python module of the CPU kernels (kernels/native.py builds it; kernels/quant.py, cpu_ops.py,
// cpu_attention.py and lora.py call it): every op's binding, in one place.
#include <torch/extension.h>

#include "attention.h"
#include "decode_stack.h"
#include "isa.h"
#include "lora_weights.h"
#include "moe_layer.h"
#include "qgemm.h"
#include "qlinear.h"
#include "rowops.h"
#include "sample_rows.h"
#include "team.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "wsllm's quantized CPU kernels (GGUF blocks); see kernels/quant.py";
  wsq::register_lora(m);  // LoraWeights first: DecodeStack.forward takes a list of them
  wsq::register_sampling(m);
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("qlinear", &wsq::qlinear, "x [M, K] float32/bfloat16 @ packed weights (+ bias) -> [M, n] in x's dtype", py::arg("x"),
        py::arg("packed"), py::arg("qtype"), py::arg("n"), py::arg("bias"), py::arg("isa"), py::arg("out_float") = false,
        nogil());
  m.def("dequant_rows", &wsq::dequant_rows, "packed weights of n rows, rows int64 [R] -> float32 [R, K]", nogil());
  m.def("add_rms_norm", &wsq::add_rms_norm, "(rms_norm(x + residual) * weight, x + residual); see rowops.h",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("isa") = 2);
  m.def("silu_mul", &wsq::silu_mul, "[T, 2 d] -> silu(gate) * up [T, d]", py::arg("x"), py::arg("isa") = 2);
  m.def("rope_store", &wsq::rope_store, "rotary on qkv's q and k in place, k and v into the caches");
  m.def("decode_attention", &wsq::decode_attention,
        "q [n, H, D] against the paged caches through tables [n, width] and lens [n] -> [n, H * D]; see fvec.h",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"), py::arg("lens"), py::arg("scale"),
        py::arg("isa"), py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none(), nogil());
  m.def("rope_store_decode", &wsq::rope_store_decode,
        "rope_store then decode_attention of qkv's rotated q rows -> [n, H * D]: a decode-only step's attention",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::arg("num_heads"), py::arg("tables"), py::arg("lens"), py::arg("scale"), py::arg("isa"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none(), nogil());
  py::class_<wsq::MoeLayer, std::shared_ptr<wsq::MoeLayer>>(m, "MoeLayer")
      .def(py::init<torch::Tensor, torch::Tensor, std::vector<torch::Tensor>, std::vector<int64_t>, int64_t, int64_t,
                    bool, double, std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<int64_t>, int64_t,
                    torch::Tensor, std::vector<torch::Tensor>, int64_t, double, double>(),
           py::arg("router"), py::arg("selection_bias"), py::arg("experts"), py::arg("qtypes"), py::arg("top_k"),
           py::arg("gating"), py::arg("renormalize"), py::arg("scale"), py::arg("shared"), py::arg("shared_qtypes"),
           py::arg("shared_ns"), py::arg("shared_gate_up"), py::arg("shared_gate"),
           py::arg("biases") = std::vector<torch::Tensor>(), py::arg("act") = 0, py::arg("alpha") = 1.702,
           py::arg("limit") = 7.0)
      .def_property_readonly("num_experts", &wsq::MoeLayer::num_experts)
      .def_property_readonly("top_k", &wsq::MoeLayer::top_k)
      .def("forward", &wsq::MoeLayer::forward, "x [T, H] -> the layer's output [T, H]; see kernels/moe.py",
           py::arg("x"), py::arg("isa"), nogil())
      .def("route", &wsq::MoeLayer::route, "x [T, H] -> (ids int32 [T, k], weights float32 [T, k])", py::arg("x"),
           py::arg("isa"), nogil())
      .def("experts", &wsq::MoeLayer::experts, "the grouped pass alone over a routing -> float32 [T, H]",
           py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("isa"), nogil());
  py::class_<wsq::DecodeStack>(m, "DecodeStack")
      .def(py::init<std::vector<int64_t>, std::vector<torch::Tensor>, std::vector<double>,
                    std::vector<std::shared_ptr<wsq::MoeLayer>>>(),
           py::arg("program"), py::arg("tensors"), py::arg("floats"),
           py::arg("moes") = std::vector<std::shared_ptr<wsq::MoeLayer>>())
      .def_property_readonly("num_steps", &wsq::DecodeStack::num_steps)
      .def("forward", &wsq::DecodeStack::forward,
           "a decode-only step's layers: x [n, hidden] -> (out, residual); see kernels/decode_stack.py",
           py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slots"), py::arg("tables"), py::arg("lens"),
           py::arg("isa"), py::arg("lora") = wsq::LoraList(), py::arg("lora_rows") = std::vector<torch::Tensor>(),
           nogil());
  m.def(
      "set_prefetch_ahead", [](int64_t bytes) { wsq::prefetch_ahead = int(bytes); },
      "bench/quantized_linear.py: how far ahead of its loads the 32-value formats' batch-1 stream prefetches (0: off)");
  m.def(
      "set_prefetch_k",
      [](int64_t k45, int64_t q6k) {
        wsq::prefetch_k45 = int(k45);
        wsq::prefetch_q6k = int(q6k);
      },
      "bench/quantized_linear.py: bytes ahead that Q4_K/Q5_K (batch 1) and Q6_K prefetch (0: off)", py::arg("k45"),
      py::arg("q6k"));
  m.def("set_teams", &wsq::set_teams, "the decode stack on one team of threads (team.h) or an at::parallel_for a loop",
        py::arg("on") = true, py::arg("hold_helpers") = false);
  m.def("team_threads", &wsq::team_threads, "threads that took chunks of a team's loop", nogil());
  m.def("parallel_threads", &wsq::parallel_threads, "threads an at::parallel_for here runs on");
  m.def("cpu_has", &wsq::cpu_has, "can this CPU run the ISA path (0 avx512_vnni, 1 avx2, 2 scalar)?");
}
