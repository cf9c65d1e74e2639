// Paddle binding of the fused cross-entropy kernel, in place:
//   fastffn_cross_entropy(logits, labels, loss, label_error?; ignore_index, grad_scale, with_grad)
// logits [rows, vocab] (fp32/fp16/bf16/fp64) becomes (softmax - onehot) * grad_scale (with_grad;
// 0 on ignored rows and rows whose loss is not > 0), loss (fp32 [rows], allocated by the caller)
// gets each row's loss. labels int64 [rows]. The LM-head GEMMs around it are the Python
// wrapper's (paddle_fastffn/ops/linear_cross_entropy.py), one chunk of tokens per call.
// label_error (optional, a zeroed int32 [1] where the logits are): on the GPU the kernel's flag
// for a label outside [0, vocab) is left in it for the caller to read; on the CPU a bad label
// raises at once, with or without it.
#include "binding_utils.h"

namespace {

using namespace fastffn::paddle_binding;
constexpr const char* kOp = "paddle_fastffn.ops.linear_cross_entropy";

void CrossEntropyInPlace(paddle::Tensor& logits, const paddle::Tensor& labels, paddle::Tensor& loss,
                         paddle::optional<paddle::Tensor>& label_error, int64_t ignore_index,
                         float grad_scale, bool with_grad) {
  PD_CHECK(logits.shape().size() == 2, kOp, ": the logits chunk must be 2-D [rows, vocab], got ",
           logits.shape().size(), " dimensions");
  check_contiguous(logits, "logits", kOp);
  const int64_t rows = logits.shape()[0];
  const int64_t vocab = logits.shape()[1];
  PD_CHECK(labels.dtype() == paddle::DataType::INT64, kOp, ": argument `labels` must be int64, got ",
           phi::DataTypeToString(labels.dtype()));
  PD_CHECK(labels.numel() == rows && labels.is_contiguous(), kOp,
           ": argument `labels` must be contiguous with one label per row (", rows, "), got ",
           labels.numel());
  PD_CHECK(loss.dtype() == paddle::DataType::FLOAT32 && loss.numel() == rows && loss.is_contiguous(),
           kOp, ": the loss buffer must be contiguous float32 [rows]");
  check_same_place(logits, labels, "labels", kOp);
  check_same_place(logits, loss, "loss", kOp);
  if (label_error) {
    PD_CHECK(label_error->dtype() == paddle::DataType::INT32 && label_error->numel() == 1, kOp,
             ": argument `label_error` must be one int32 (a zeroed flag), got ",
             phi::DataTypeToString(label_error->dtype()), " with ", label_error->numel(), " elements");
    check_same_place(logits, *label_error, "label_error", kOp);
  }

  fastffn_cross_entropy_args args;
  args.rows = rows;
  args.vocab = vocab;
  args.row_stride = vocab;
  args.ignore_index = ignore_index;
  args.grad_scale = grad_scale;
  args.with_grad = with_grad ? 1 : 0;
  args.dtype = kernel_dtype(logits, kOp, "logits");
  args.label_error = nullptr;
  const fastffn_status status = run_on_device(
      logits, kOp,
      [&] {
        return fastffn_cross_entropy_cpu(args, logits.data(), labels.data<int64_t>(),
                                         loss.data<float>());
      },
      [&](void* stream) {
        // The labels live on the device: the kernel flags one outside [0, vocab). With
        // `label_error` the flag stays there for the caller to read once for all chunks, with
        // the loss's other values (no synchronisation here); without it one 4-byte copy reads
        // it now (a synchronisation per call, like rotary's position check).
        if (label_error) {
          args.label_error = label_error->data<int32_t>();
          return fastffn_cross_entropy_cuda(args, logits.data(), labels.data<int64_t>(),
                                            loss.data<float>(), stream);
        }
        paddle::Tensor error = paddle::full({1}, 0, paddle::DataType::INT32, logits.place());
        args.label_error = error.data<int32_t>();
        fastffn_status cuda_status = fastffn_cross_entropy_cuda(
            args, logits.data(), labels.data<int64_t>(), loss.data<float>(), stream);
        if (cuda_status == FASTFFN_STATUS_OK &&
            error.copy_to(paddle::CPUPlace(), true).data<int32_t>()[0] != 0)
          cuda_status = FASTFFN_STATUS_INVALID_ARGUMENT;
        return cuda_status;
      });
  // On the GPU the labels are on the device: the kernel's flag says only that one was bad.
  if (status == FASTFFN_STATUS_INVALID_ARGUMENT && !labels.is_cpu())
    PD_THROW(kOp, ": argument `labels` holds a label outside the vocabulary [0, ", vocab,
             ") that is not ignore_index (", ignore_index, ")");
  check_status(status, kOp);
}

}  // namespace

PD_BUILD_OP(fastffn_cross_entropy)
    .Inputs({"Logits", "Labels", "Loss", paddle::Optional("LabelError")})
    .Outputs({"DLogits", "LossOut", paddle::Optional("LabelErrorOut")})
    .Attrs({"ignore_index: int64_t", "grad_scale: float", "with_grad: bool"})
    .SetInplaceMap({{"Logits", "DLogits"},
                    {"Loss", "LossOut"},
                    {paddle::Optional("LabelError"), paddle::Optional("LabelErrorOut")}})
    .SetKernelFn(PD_KERNEL(CrossEntropyInPlace));
