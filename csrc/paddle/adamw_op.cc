// Paddle binding of the AdamW kernel (fastffn/optimizer.h), in place like Paddle's adamw_:
//   fastffn_adamw_(param, grad, learning_rate, moment1, moment2, beta1_pow, beta2_pow,
//                  master_param?, grad_scale?, compensation?, moment1_absmax?, moment2_absmax?,
//                  param_amax?; beta1, beta2, epsilon, lr_ratio, coeff, with_decay)
// updates param, moment1, moment2 and master_param or compensation (when given) in one pass
// (fastffn_adamw_with_state_*): moments are float32, or uint8 codes with their float32 absmax per
// block of FASTFFN_ADAMW_QUANT_BLOCK elements (8-bit moments); param_amax (one float32 where the
// parameter lives) is set to the updated parameter's max |x|; then it multiplies the
// beta powers by beta1 / beta2 as Paddle's kernel does after each parameter's step. The scalars
// (learning_rate, beta powers, grad_scale) are one-element fp32 tensors on the CPU, whose value is
// read here, or on the parameter's GPU, whose address the kernel reads: Paddle keeps its learning
// rate on the device and its beta powers on the CPU.
#include <tuple>

#include "binding_utils.h"
#include "fastffn/optimizer.h"

namespace {

using namespace fastffn::paddle_binding;
constexpr const char* kOp = "paddle_fastffn.optim.adamw";

void check_like_param(const paddle::Tensor& param, const paddle::Tensor& t, const char* arg) {
  check_contiguous(t, arg, kOp);
  check_same_place(param, t, arg, kOp);
  PD_CHECK(t.numel() == param.numel(), kOp, ": argument `", arg, "` must have the ",
           param.numel(), " elements of `param`, got ", t.numel());
}

void check_fp32(const paddle::Tensor& t, const char* arg) {
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT32, kOp, ": argument `", arg,
           "` must be float32, got ", phi::DataTypeToString(t.dtype()));
}

// A one-element fp32 tensor as a kernel scalar: its value when it lives on the CPU, its address
// when it lives where the parameter does (the CUDA kernel reads it there).
fastffn_scalar scalar_of(const paddle::Tensor& t, const paddle::Tensor& param, const char* arg) {
  check_fp32(t, arg);
  PD_CHECK(t.numel() == 1, kOp, ": argument `", arg, "` must hold one value, got ", t.numel());
  if (t.is_cpu()) return {*t.data<float>(), nullptr};
  PD_CHECK(t.place() == param.place(), kOp, ": argument `", arg,
           "` must be on the CPU or on the device of `param`");
  return {0.f, t.data<float>()};
}

// The beta powers after the step, where they live.
fastffn_status update_pows(paddle::Tensor& beta1_pow, paddle::Tensor& beta2_pow, float beta1,
                           float beta2) {
  PD_CHECK(beta1_pow.place() == beta2_pow.place(), kOp,
           ": arguments `beta1_pow` and `beta2_pow` must be on one device");
  return run_on_device(
      beta1_pow, kOp,
      [&] {
        return fastffn_adamw_update_pows_cpu(beta1, beta2, beta1_pow.data<float>(),
                                             beta2_pow.data<float>());
      },
      [&](void* stream) {
        return fastffn_adamw_update_pows_cuda(beta1, beta2, beta1_pow.data<float>(),
                                              beta2_pow.data<float>(), stream);
      });
}

// The moments' layout: float32 without absmax, or uint8 codes with one float32 absmax per block.
fastffn_moments moment_layout(const paddle::Tensor& param, const paddle::Tensor& moment1,
                              const paddle::Tensor& moment2,
                              const paddle::optional<paddle::Tensor>& absmax1,
                              const paddle::optional<paddle::Tensor>& absmax2) {
  const bool blockwise = moment1.dtype() == paddle::DataType::UINT8;
  const int64_t blocks = (param.numel() + FASTFFN_ADAMW_QUANT_BLOCK - 1) / FASTFFN_ADAMW_QUANT_BLOCK;
  for (auto [t, absmax, arg, absmax_arg] :
       {std::tuple<const paddle::Tensor*, const paddle::optional<paddle::Tensor>*, const char*,
                   const char*>{&moment1, &absmax1, "moment1", "moment1_absmax"},
        {&moment2, &absmax2, "moment2", "moment2_absmax"}}) {
    check_like_param(param, *t, arg);
    if (!blockwise) {
      check_fp32(*t, arg);
      PD_CHECK(!*absmax, kOp, ": argument `", absmax_arg, "` goes with uint8 (8-bit) moments only");
      continue;
    }
    PD_CHECK(t->dtype() == paddle::DataType::UINT8, kOp, ": argument `", arg,
             "` must be uint8 like `moment1`, got ", phi::DataTypeToString(t->dtype()));
    PD_CHECK(*absmax, kOp, ": argument `", absmax_arg, "` is needed with uint8 (8-bit) moments");
    check_contiguous(**absmax, absmax_arg, kOp);
    check_same_place(param, **absmax, absmax_arg, kOp);
    check_fp32(**absmax, absmax_arg);
    PD_CHECK((*absmax)->numel() == blocks, kOp, ": argument `", absmax_arg, "` must have ", blocks,
             " elements (one per ", FASTFFN_ADAMW_QUANT_BLOCK, " of `param`), got ",
             (*absmax)->numel());
  }
  return blockwise ? FASTFFN_MOMENTS_BLOCKWISE_8BIT : FASTFFN_MOMENTS_FLOAT32;
}

float* data_or_null(paddle::optional<paddle::Tensor>& t) {
  return t ? t->data<float>() : nullptr;
}

void AdamwInPlace(paddle::Tensor& param, const paddle::Tensor& grad,
                  const paddle::Tensor& learning_rate, paddle::Tensor& moment1,
                  paddle::Tensor& moment2, paddle::Tensor& beta1_pow, paddle::Tensor& beta2_pow,
                  paddle::optional<paddle::Tensor>& master_param,
                  const paddle::optional<paddle::Tensor>& grad_scale,
                  paddle::optional<paddle::Tensor>& compensation,
                  paddle::optional<paddle::Tensor>& moment1_absmax,
                  paddle::optional<paddle::Tensor>& moment2_absmax,
                  paddle::optional<paddle::Tensor>& param_amax, float beta1, float beta2,
                  float epsilon, float lr_ratio, float coeff, bool with_decay) {
  check_contiguous(param, "param", kOp);
  fastffn_adamw_args args{};
  args.n = param.numel();
  // The dtype rules (param float32/float16/bfloat16, grad param's dtype or float32, compensation
  // only for 16-bit params and not with a master) are the C layer's (fastffn_adamw_*:
  // check_adamw_state), reported through check_status.
  args.param_dtype = kernel_dtype(param, kOp, "param");
  check_like_param(param, grad, "grad");
  args.grad_dtype = kernel_dtype(grad, kOp, "grad");
  fastffn_adamw_state state{};
  state.moments = moment_layout(param, moment1, moment2, moment1_absmax, moment2_absmax);
  state.moment1 = moment1.data();
  state.moment2 = moment2.data();
  state.absmax1 = data_or_null(moment1_absmax);
  state.absmax2 = data_or_null(moment2_absmax);
  if (master_param) {
    check_like_param(param, *master_param, "master_param");
    check_fp32(*master_param, "master_param");
    state.master = master_param->data<float>();
  }
  if (compensation) {
    check_like_param(param, *compensation, "compensation");
    PD_CHECK(compensation->dtype() == param.dtype(), kOp,
             ": argument `compensation` must have the dtype of `param` (",
             phi::DataTypeToString(param.dtype()), "), got ",
             phi::DataTypeToString(compensation->dtype()));
    state.compensation = compensation->data();
  }
  if (param_amax) {
    check_contiguous(*param_amax, "param_amax", kOp);
    check_same_place(param, *param_amax, "param_amax", kOp);
    check_fp32(*param_amax, "param_amax");
    PD_CHECK(param_amax->numel() == 1, kOp, ": argument `param_amax` must hold one value, got ",
             param_amax->numel());
    state.param_amax = param_amax->data<float>();
  }
  args.beta1 = beta1;
  args.beta2 = beta2;
  args.epsilon = epsilon;
  args.coeff = coeff;
  args.lr_ratio = lr_ratio;
  args.with_decay = with_decay ? 1 : 0;
  args.lr = scalar_of(learning_rate, param, "learning_rate");
  args.beta1_pow = scalar_of(beta1_pow, param, "beta1_pow");
  args.beta2_pow = scalar_of(beta2_pow, param, "beta2_pow");
  args.grad_scale = grad_scale ? scalar_of(*grad_scale, param, "grad_scale")
                               : fastffn_scalar{1.f, nullptr};
  check_status(run_on_device(
                   param, kOp,
                   [&] { return fastffn_adamw_with_state_cpu(args, param.data(), grad.data(), state); },
                   [&](void* stream) {
                     return fastffn_adamw_with_state_cuda(args, param.data(), grad.data(), state,
                                                          stream);
                   }),
               kOp);
  check_status(update_pows(beta1_pow, beta2_pow, beta1, beta2), kOp);
}

}  // namespace

PD_BUILD_OP(fastffn_adamw_)
    .Inputs({"Param", "Grad", "LearningRate", "Moment1", "Moment2", "Beta1Pow", "Beta2Pow",
             paddle::Optional("MasterParam"), paddle::Optional("GradScale"),
             paddle::Optional("Compensation"), paddle::Optional("Moment1Absmax"),
             paddle::Optional("Moment2Absmax"), paddle::Optional("ParamAmax")})
    .Outputs({"ParamOut", "Moment1Out", "Moment2Out", "Beta1PowOut", "Beta2PowOut",
              paddle::Optional("MasterParamOut"), paddle::Optional("CompensationOut"),
              paddle::Optional("Moment1AbsmaxOut"), paddle::Optional("Moment2AbsmaxOut"),
              paddle::Optional("ParamAmaxOut")})
    .Attrs({"beta1: float", "beta2: float", "epsilon: float", "lr_ratio: float", "coeff: float",
            "with_decay: bool"})
    .SetInplaceMap({{"Param", "ParamOut"},
                    {"Moment1", "Moment1Out"},
                    {"Moment2", "Moment2Out"},
                    {"Beta1Pow", "Beta1PowOut"},
                    {"Beta2Pow", "Beta2PowOut"},
                    {paddle::Optional("MasterParam"), paddle::Optional("MasterParamOut")},
                    {paddle::Optional("Compensation"), paddle::Optional("CompensationOut")},
                    {paddle::Optional("Moment1Absmax"), paddle::Optional("Moment1AbsmaxOut")},
                    {paddle::Optional("Moment2Absmax"), paddle::Optional("Moment2AbsmaxOut")},
                    {paddle::Optional("ParamAmax"), paddle::Optional("ParamAmaxOut")}})
    .SetKernelFn(PD_KERNEL(AdamwInPlace));
