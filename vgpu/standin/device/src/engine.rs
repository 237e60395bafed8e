//! The card's engine word and the round robin, as pure functions (the shared-memory protocol that
//! uses them is in `lib.rs`).
//!
//! One `u64` says whose turn it is: bits 0-7 the owner's slot + 1 (0: nobody), bit 8 whether one
//! of the owner's kernels runs now, bits 9-63 when the owner's turn began (microseconds since the
//! Unix epoch). Changing all three with one compare-and-swap is what lets a waiter take the engine
//! from an owner whose turn is over without ever running two kernels at once: the owner marks a
//! kernel running with a CAS from the very word the waiter replaces.

const OWNER_MASK: u64 = 0xFF;
const RUNNING: u64 = 1 << 8;
const TURN_SHIFT: u32 = 9;

/// The decoded engine word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct State {
    /// Slot + 1 of the process whose turn it is; 0 when nobody's.
    pub owner: u32,
    /// A kernel of the owner runs now.
    pub running: bool,
    /// When the owner's turn began, microseconds since the Unix epoch.
    pub turn_us: u64,
}

impl State {
    pub const IDLE: State = State {
        owner: 0,
        running: false,
        turn_us: 0,
    };

    pub fn pack(self) -> u64 {
        u64::from(self.owner) & OWNER_MASK
            | if self.running { RUNNING } else { 0 }
            | self.turn_us << TURN_SHIFT
    }

    pub fn unpack(word: u64) -> State {
        State {
            owner: (word & OWNER_MASK) as u32,
            running: word & RUNNING != 0,
            turn_us: word >> TURN_SHIFT,
        }
    }

    /// A turn for `slot` beginning at `now_us`, no kernel running yet.
    pub fn turn_of(slot: usize, now_us: u64) -> State {
        State {
            owner: slot as u32 + 1,
            running: false,
            turn_us: now_us,
        }
    }

    /// Whether the turn has lasted its timeslice by `now_us`.
    pub fn turn_over(self, now_us: u64, timeslice_us: u64) -> bool {
        now_us >= self.turn_us.saturating_add(timeslice_us)
    }
}

/// The slot whose turn comes after `slot`'s among `waiters` (one bit per slot), round robin:
/// the first waiting slot after `slot`, wrapping around; `slot` itself only if nobody else waits
/// and it does. None when nobody waits.
pub fn next_after(slot: usize, waiters: u64) -> Option<usize> {
    if waiters == 0 {
        return None;
    }
    let rotated = waiters.rotate_right((slot as u32 + 1) % 64);
    Some((slot + 1 + rotated.trailing_zeros() as usize) % 64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_word_round_trips() {
        for state in [
            State::IDLE,
            State::turn_of(0, 1_765_000_000_000_000),
            State {
                owner: 64,
                running: true,
                turn_us: (1 << 55) - 1,
            },
        ] {
            assert_eq!(State::unpack(state.pack()), state);
        }
        assert_eq!(State::IDLE.pack(), 0);
    }

    #[test]
    fn a_turn_is_over_after_its_timeslice() {
        let s = State::turn_of(3, 1000);
        assert!(!s.turn_over(2999, 2000));
        assert!(s.turn_over(3000, 2000));
        assert!(State {
            turn_us: u64::MAX >> 9,
            ..s
        }
        .turn_over(u64::MAX >> 9, 0));
    }

    #[test]
    fn turns_go_round_robin() {
        let bits = |slots: &[usize]| slots.iter().fold(0u64, |b, &s| b | 1 << s);
        assert_eq!(next_after(0, 0), None);
        assert_eq!(next_after(0, bits(&[1, 5])), Some(1));
        assert_eq!(next_after(1, bits(&[1, 5])), Some(5));
        assert_eq!(next_after(5, bits(&[1, 5])), Some(1));
        assert_eq!(next_after(63, bits(&[0, 63])), Some(0));
        assert_eq!(next_after(7, bits(&[7])), Some(7));
        assert_eq!(next_after(2, bits(&[0, 1, 2])), Some(0));
    }
}
