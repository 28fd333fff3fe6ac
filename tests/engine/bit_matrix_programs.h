// bit_matrix's step programs (bit_matrix_programs.cpp): one hash per
// configuration of the compiled program. Returns 1 if a configuration failed.
#pragma once

namespace strider {

int print_programs();

}  // namespace strider
