// Pool id mapping between torch and streamalloc: Note [pool ids].
#include "torch_pool_ids.hpp"

#include <c10/util/Exception.h>

namespace streamalloc {
namespace {

constexpr pool_id k_user_pool_bit = pool_id{1} << 63;

}  // namespace

pool_id to_pool_id(c10::MempoolId_t id) {
  if (id.first == 0 && id.second == 0) return 0;
  const bool one_side = (id.first == 0) != (id.second == 0);
  const pool_id value = id.first != 0 ? id.first : id.second;
  TORCH_CHECK(one_side && (value & k_user_pool_bit) == 0, "streamalloc: unsupported memory pool id (", id.first, ", ",
              id.second, ")");
  return id.first != 0 ? value : (value | k_user_pool_bit);
}

c10::MempoolId_t to_mempool_id(pool_id id) {
  if (id == 0) return {0, 0};
  if ((id & k_user_pool_bit) != 0) return {0, id & ~k_user_pool_bit};
  return {id, 0};
}

}  // namespace streamalloc
