//! The wrappers: one per (function, ABI variant, stream variant), each calling its own real
//! pointer. Each exists twice: exported under the driver's name (found by `dlsym` on the driver's
//! handle through our `dlsym`, by programs linked against the driver, and by `cuGetProcAddress`
//! when the driver returns its exported function), and unexported for an address
//! `cuGetProcAddress` returned that is not an exported symbol (see `symbols.rs`).
//!
//! Every wrapper runs its body inside `catch_unwind`: a panic of ours becomes
//! `CUDA_ERROR_UNKNOWN` / `NVML_ERROR_UNKNOWN` and a stderr line, never an abort of the program.
//! No lock of ours is held while the real driver runs.
//!
//! The handlers, by concern: [`lookup`] (our `dlsym`, `cuInit`, `cuGetProcAddress`), [`memory`]
//! (views, allocations, contexts), [`launch`] (the compute limiter's gate).

#![allow(clippy::missing_safety_doc, clippy::too_many_arguments)]

mod launch;
mod lookup;
mod memory;

use crate::cuda::*;
use crate::entry_points::{for_each_entry_point, pfn, Sym};
use crate::interpose::{library_of, real, warn_once, Origin, NVML};
use launch::*;
use lookup::*;
use memory::*;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::panic::AssertUnwindSafe;

macro_rules! define_wrappers {
    ($( $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) => $handler:path ; )*) => {
        impl Sym {
            /// Our exported wrapper of this variant.
            pub fn exported_wrapper(self) -> usize {
                match self { $(Sym::$name => exported::$name as *const () as usize,)* }
            }

            /// Our unexported wrapper, for an address `cuGetProcAddress` returned.
            pub fn procaddr_wrapper(self) -> usize {
                match self { $(Sym::$name => procaddr::$name as *const () as usize,)* }
            }
        }

        /// Exported under the driver's names.
        pub mod exported {
            use super::*;
            $(
                #[no_mangle]
                #[allow(non_snake_case)]
                pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_int {
                    call(Sym::$name, Origin::Export, |addr| {
                        // SAFETY: addr is the driver's function of this variant, of this type.
                        let real: pfn::$name = unsafe { std::mem::transmute::<usize, pfn::$name>(addr) };
                        unsafe { $handler(real, $($arg),*) }
                    })
                }
            )*
        }

        /// For addresses `cuGetProcAddress` returned that match no exported symbol.
        pub mod procaddr {
            use super::*;
            $(
                #[allow(non_snake_case)]
                pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_int {
                    call(Sym::$name, Origin::ProcAddr, |addr| {
                        // SAFETY: as above; the ABI was chosen by version and flags (symbols.rs).
                        let real: pfn::$name = unsafe { std::mem::transmute::<usize, pfn::$name>(addr) };
                        unsafe { $handler(real, $($arg),*) }
                    })
                }
            )*
        }
    };
}

/// Runs a wrapper's body with the real function's address, turning a panic into an error code.
fn call(sym: Sym, origin: Origin, body: impl FnOnce(usize) -> c_int) -> c_int {
    let nvml = std::ptr::eq(library_of(sym), &NVML);
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| match real(sym, origin) {
        Some(addr) => body(addr),
        None => {
            warn_once(sym, "is not in the driver library; the call fails");
            if nvml {
                13 // NVML_ERROR_FUNCTION_NOT_FOUND
            } else {
                CUDA_ERROR_NOT_FOUND
            }
        }
    }));
    outcome.unwrap_or_else(|_| {
        log_error!(
            "internal error in the {} wrapper; the call returns an error instead",
            sym.name()
        );
        if nvml {
            NVML_ERROR_UNKNOWN
        } else {
            CUDA_ERROR_UNKNOWN
        }
    })
}

for_each_entry_point!(define_wrappers);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_point_has_two_wrappers() {
        for sym in Sym::ALL {
            assert_ne!(sym.exported_wrapper(), sym.procaddr_wrapper());
        }
    }
}
