//! Kubernetes resource quantities ("8Gi", "1500M", "50", "500m", "1.5Gi", "1e3") as exact integers.
//!
//! One parser for the whole project: the driver reads `consumedCapacity`, the scheduler stand-in
//! rounds requests to a policy's step, the validation checks defaults against steps.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
#[error("invalid quantity {input:?}: {reason}")]
pub struct QuantityError {
    pub input: String,
    pub reason: &'static str,
}

/// A quantity in thousandths of its unit, so that both "500m" cores and "40Gi" bytes are exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Milli(pub i128);

impl Milli {
    pub fn from_units(units: i128) -> Self {
        Milli(units * 1000)
    }

    /// Whole units, rounded up (a request of 500m cores needs 1 core).
    pub fn ceil_units(self) -> i128 {
        self.0.div_euclid(1000) + i128::from(self.0.rem_euclid(1000) != 0)
    }
}

/// Parse a Kubernetes quantity.
pub fn parse(input: &str) -> Result<Milli, QuantityError> {
    let err = |reason| QuantityError {
        input: input.to_string(),
        reason,
    };
    let s = input.trim();
    if s.is_empty() {
        return Err(err("empty"));
    }
    let (negative, s) = match s.as_bytes()[0] {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    let number_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(number_end);
    if number.is_empty() || number == "." || number.matches('.').count() > 1 {
        return Err(err("no number"));
    }
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    // Value as mantissa * 10^-frac_len.
    let digits = format!("{whole}{frac}");
    let mantissa: i128 = if digits.is_empty() {
        0
    } else {
        digits.parse().map_err(|_| err("number too large"))?
    };
    let mut decimal_exp: i32 = -(frac.len() as i32);
    let mut binary_mult: i128 = 1;
    match suffix {
        "" => {}
        "Ki" => binary_mult = 1 << 10,
        "Mi" => binary_mult = 1 << 20,
        "Gi" => binary_mult = 1 << 30,
        "Ti" => binary_mult = 1 << 40,
        "Pi" => binary_mult = 1 << 50,
        "Ei" => binary_mult = 1 << 60,
        "n" => decimal_exp -= 9,
        "u" => decimal_exp -= 6,
        "m" => decimal_exp -= 3,
        "k" => decimal_exp += 3,
        "M" => decimal_exp += 6,
        "G" => decimal_exp += 9,
        "T" => decimal_exp += 12,
        "P" => decimal_exp += 15,
        "E" => decimal_exp += 18,
        s if s.starts_with(['e', 'E']) => {
            let exp: i32 = s[1..].parse().map_err(|_| err("bad exponent"))?;
            decimal_exp += exp;
        }
        _ => return Err(err("unknown suffix")),
    }
    // Milli = mantissa * binary_mult * 10^(decimal_exp + 3), rounded up like Kubernetes does.
    let scaled = mantissa
        .checked_mul(binary_mult)
        .ok_or_else(|| err("number too large"))?;
    let exp = decimal_exp + 3;
    let value = if exp >= 0 {
        10i128
            .checked_pow(exp as u32)
            .and_then(|p| scaled.checked_mul(p))
            .ok_or_else(|| err("number too large"))?
    } else {
        let p = 10i128
            .checked_pow((-exp) as u32)
            .ok_or_else(|| err("number too small"))?;
        scaled / p + i128::from(scaled % p != 0)
    };
    Ok(Milli(if negative { -value } else { value }))
}

/// A whole number of bytes in the canonical binary form Kubernetes prints: "40Gi", "1431Mi", "1500".
pub fn format_bytes(bytes: u64) -> String {
    const SUFFIXES: [(&str, u32); 6] = [
        ("Ei", 60),
        ("Pi", 50),
        ("Ti", 40),
        ("Gi", 30),
        ("Mi", 20),
        ("Ki", 10),
    ];
    if bytes == 0 {
        return "0".to_string();
    }
    for (suffix, shift) in SUFFIXES {
        let unit = 1u64 << shift;
        if bytes.is_multiple_of(unit) {
            return format!("{}{suffix}", bytes / unit);
        }
    }
    bytes.to_string()
}

/// A quantity as Kubernetes prints it in decimal form: "50", "500m".
pub fn format_milli(value: Milli) -> String {
    if value.0 % 1000 == 0 {
        (value.0 / 1000).to_string()
    } else {
        format!("{}m", value.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_decimal_and_milli() {
        assert_eq!(parse("8Gi").unwrap(), Milli::from_units(8 << 30));
        assert_eq!(parse("1500M").unwrap(), Milli::from_units(1_500_000_000));
        assert_eq!(parse("50").unwrap(), Milli::from_units(50));
        assert_eq!(parse("500m").unwrap(), Milli(500));
        assert_eq!(parse("1.5Gi").unwrap(), Milli::from_units(3 << 29));
        assert_eq!(parse("1e3").unwrap(), Milli::from_units(1000));
        assert!(parse("8GB").is_err());
        assert!(parse("").is_err());
    }

    #[test]
    fn rounds_up_to_whole_units() {
        assert_eq!(parse("500m").unwrap().ceil_units(), 1);
        assert_eq!(parse("1").unwrap().ceil_units(), 1);
    }

    #[test]
    fn formats_like_kubernetes() {
        assert_eq!(format_bytes(40 << 30), "40Gi");
        assert_eq!(format_bytes(1431 << 20), "1431Mi");
        assert_eq!(format_bytes(1500), "1500");
        assert_eq!(format_milli(Milli(500)), "500m");
        assert_eq!(format_milli(Milli::from_units(61)), "61");
    }
}
