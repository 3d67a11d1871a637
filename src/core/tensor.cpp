#include "fusetrain/core/tensor.h"

#include <cstring>

#include "fusetrain/core/alloc.h"
#include "fusetrain/core/half.h"

namespace fusetrain {

Tensor Tensor::view(void* data, Shape shape, DType dtype) {
  Tensor t;
  t.data_ = data;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::view_shared(void* data, Shape shape, DType dtype, std::shared_ptr<void> keep_alive) {
  Tensor t = view(data, std::move(shape), dtype);
  t.storage_ = std::move(keep_alive);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype) {
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  AlignedPtr memory = aligned_allocate(t.nbytes());
  t.data_ = memory.get();
  t.storage_ = std::shared_ptr<void>(memory.release(), AlignedFree());
  return t;
}

Tensor Tensor::reshaped(Shape shape) const {
  FT_CHECK(shape.numel() == numel(), "cannot reshape ", shape_.to_string(), " (", numel(), " elements) to ",
           shape.to_string(), " (", shape.numel(), " elements)");
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

double Tensor::item(int64_t i) const {
  FT_CHECK(i >= 0 && i < numel(), "element ", i, " is out of range for shape ", shape_.to_string());
  const char* p = static_cast<const char*>(data_) + i * static_cast<int64_t>(dtype_size(dtype_));
  switch (dtype_) {
    case DType::f32: {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DType::bf16: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return bf16_to_float(v);
    }
    case DType::f16: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return f16_to_float(v);
    }
    case DType::i64: {
      int64_t v;
      std::memcpy(&v, p, 8);
      return static_cast<double>(v);
    }
    case DType::i32: {
      int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DType::u8:
      return static_cast<unsigned char>(*p);
  }
  return 0;
}

void Tensor::set_item(int64_t i, double value) {
  FT_CHECK(i >= 0 && i < numel(), "element ", i, " is out of range for shape ", shape_.to_string());
  char* p = static_cast<char*>(data_) + i * static_cast<int64_t>(dtype_size(dtype_));
  switch (dtype_) {
    case DType::f32: {
      float v = static_cast<float>(value);
      std::memcpy(p, &v, 4);
      break;
    }
    case DType::bf16: {
      uint16_t v = float_to_bf16(static_cast<float>(value));
      std::memcpy(p, &v, 2);
      break;
    }
    case DType::f16: {
      uint16_t v = float_to_f16(static_cast<float>(value));
      std::memcpy(p, &v, 2);
      break;
    }
    case DType::i64: {
      int64_t v = static_cast<int64_t>(value);
      std::memcpy(p, &v, 8);
      break;
    }
    case DType::i32: {
      int32_t v = static_cast<int32_t>(value);
      std::memcpy(p, &v, 4);
      break;
    }
    case DType::u8:
      *p = static_cast<char>(static_cast<unsigned char>(value));
      break;
  }
}

void Tensor::copy_from(const Tensor& src) {
  FT_CHECK(src.shape() == shape_ && src.dtype() == dtype_, "copy_from: expected ", dtype_name(dtype_), " ",
           shape_.to_string(), ", found ", dtype_name(src.dtype()), " ", src.shape().to_string());
  if (nbytes()) std::memmove(data_, src.data(), nbytes());
}

Tensor Tensor::clone() const {
  Tensor t = zeros(shape_, dtype_);
  t.copy_from(*this);
  return t;
}

}  // namespace fusetrain
