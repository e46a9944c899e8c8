//! Every form of the grammar, and the errors, each at its byte.

use super::*;

fn reg(name: &str) -> Register {
    Register::from_name(name).expect("test register")
}

fn one(text: &str) -> ArgSpec {
    match parse_args(text) {
        Ok(mut args) if args.len() == 1 => args.remove(0),
        other => panic!("{text:?} gave {other:?}"),
    }
}

fn memory(text: &str) -> MemOperand {
    match one(text).operand {
        Operand::Memory(m) => m,
        other => panic!("{text:?} gave {other:?}"),
    }
}

fn err(text: &str) -> ParseError {
    match parse_args(text) {
        Err(e) => e,
        Ok(args) => panic!("{text:?} parsed as {args:?}"),
    }
}

/// Checks the error's position and that the message names spec, position and `needle`.
fn check_err(text: &str, position: usize, needle: &str) -> ParseError {
    let e = err(text);
    let msg = e.to_string();
    assert_eq!(e.position, position, "{msg}");
    assert!(msg.contains(&format!("at byte {position}")), "{msg}");
    assert!(msg.contains(&format!("{text:?}")), "{msg}");
    assert!(msg.contains(needle), "{msg} lacks {needle:?}");
    e
}

#[test]
fn empty_text_has_no_args() {
    assert_eq!(parse_args(""), Ok(vec![]));
    assert_eq!(parse_args(" \t\n "), Ok(vec![]));
}

#[test]
fn sizes_and_signs() {
    for (text, size, signed) in [
        ("1@%al", 1, false),
        ("-1@%al", 1, true),
        ("2@%ax", 2, false),
        ("-2@%ax", 2, true),
        ("4@%eax", 4, false),
        ("-4@%eax", 4, true),
        ("8@%rax", 8, false),
        ("-8@%rax", 8, true),
    ] {
        let a = one(text);
        assert_eq!((a.size, a.signed), (size, signed), "{text}");
    }
}

#[test]
fn register_operands() {
    for name in [
        "rax", "eax", "ax", "al", "ah", "r8d", "r8w", "r8b", "sil", "dil", "rip",
    ] {
        let a = one(&format!("8@%{name}"));
        assert_eq!(a.operand, Operand::Register(reg(name)));
    }
}

#[test]
fn bare_operand_is_8_unsigned() {
    let a = one("%rax");
    assert_eq!((a.size, a.signed), (8, false));
    assert_eq!(a.operand, Operand::Register(reg("rax")));
    let m = memory("-8(%rbp)");
    assert_eq!(m.displacement, Displacement::Absolute(-8));
    assert_eq!(one("-8(%rbp)").size, 8);
    assert_eq!(one("$5").operand, Operand::Immediate(5));
}

#[test]
fn immediates() {
    for (text, value) in [
        ("-1@$5", 5),
        ("8@$-5", -5),
        ("8@$0x10", 16),
        ("8@$0X1f", 31),
        ("8@$-0x10", -16),
        ("8@$0", 0),
        ("8@$0xffffffffffffffff", -1),
        ("8@$-9223372036854775808", i64::MIN),
        ("8@$18446744073709551615", -1),
    ] {
        assert_eq!(one(text).operand, Operand::Immediate(value), "{text}");
    }
}

#[test]
fn memory_forms() {
    let m = memory("8@(%rax)");
    assert_eq!(
        m,
        MemOperand {
            displacement: Displacement::Absolute(0),
            base: Some(reg("rax")),
            index: None,
            scale: 1
        }
    );
    let m = memory("-4@112(%rsp)");
    assert_eq!(
        (m.displacement, m.base),
        (Displacement::Absolute(112), Some(reg("rsp")))
    );
    let m = memory("8@0x70(%rsp)");
    assert_eq!(m.displacement, Displacement::Absolute(0x70));
    let m = memory("8@-0x10(%rbp)");
    assert_eq!(m.displacement, Displacement::Absolute(-16));
    let m = memory("8@-8(%rbp,%rax,8)");
    assert_eq!(
        m,
        MemOperand {
            displacement: Displacement::Absolute(-8),
            base: Some(reg("rbp")),
            index: Some(reg("rax")),
            scale: 8
        }
    );
    let m = memory("4@(,%rcx,4)");
    assert_eq!((m.base, m.index, m.scale), (None, Some(reg("rcx")), 4));
    let m = memory("4@16(,%r9,2)");
    assert_eq!(
        (m.displacement, m.base, m.index, m.scale),
        (Displacement::Absolute(16), None, Some(reg("r9")), 2)
    );
    let m = memory("2@(%rdi,%rsi)");
    assert_eq!(
        (m.base, m.index, m.scale),
        (Some(reg("rdi")), Some(reg("rsi")), 1)
    );
    let m = memory("1@(%rdi,%rsi,1)");
    assert_eq!(m.scale, 1);
    let m = memory("4@(%eax,%ebx,2)");
    assert_eq!((m.base, m.index), (Some(reg("eax")), Some(reg("ebx"))));
    let m = memory("8@16(%rip)");
    assert_eq!(
        (m.displacement, m.base),
        (Displacement::Absolute(16), Some(reg("rip")))
    );
    let m = memory("8@4096");
    assert_eq!(
        (m.displacement, m.base, m.index),
        (Displacement::Absolute(4096), None, None)
    );
}

#[test]
fn symbols() {
    let sym = |name: &str, offset| Displacement::Symbol {
        name: name.into(),
        offset,
    };
    let m = memory("8@_PyRuntime+16(%rip)");
    assert_eq!(
        (m.displacement, m.base),
        (sym("_PyRuntime", 16), Some(reg("rip")))
    );
    assert_eq!(memory("4@foo(%rip)").displacement, sym("foo", 0));
    assert_eq!(memory("4@foo-8(%rip)").displacement, sym("foo", -8));
    assert_eq!(memory("4@foo+0x20(%rip)").displacement, sym("foo", 32));
    assert_eq!(
        memory("4@.L.str$1.2(%rip)").displacement,
        sym(".L.str$1.2", 0)
    );
    assert_eq!(memory("4@a1_b(%rax)").base, Some(reg("rax")));
    let m = memory("8@table(,%rax,8)");
    assert_eq!(
        (m.displacement, m.index, m.scale),
        (sym("table", 0), Some(reg("rax")), 8)
    );
    let m = memory("8@counter");
    assert_eq!((m.displacement, m.base), (sym("counter", 0), None));
}

#[test]
fn whitespace_separation() {
    let args = parse_args("  8@%rbp\t-4@%eax\n\n-4@112(%rsp)  ").expect("parses");
    assert_eq!(args.len(), 3);
    let args = parse_args(
        "8@%rbp -4@%eax -4@112(%rsp) 8@-8(%rbp,%rax,8) -1@$5 8@_PyRuntime+16(%rip) 4@foo(%rip)",
    )
    .expect("parses");
    assert_eq!(args.len(), 7);
}

#[test]
fn uppercase_registers() {
    assert_eq!(one("8@%RAX").operand, Operand::Register(reg("rax")));
}

#[test]
fn parse_arg_takes_exactly_one() {
    assert_eq!(parse_arg(" 8@%rax ").map(|a| a.size), Ok(8));
    let e = parse_arg("8@%rax 8@%rbx").expect_err("two args");
    assert_eq!(e.position, 7);
    assert!(e.to_string().contains("end of argument"));
    assert!(parse_arg("").is_err());
}

#[test]
fn error_unknown_register() {
    let e = check_err("8@%rbp 8@%foo", 9, "unknown register %foo");
    assert_eq!(e.kind, ParseErrorKind::UnknownRegister("foo".into()));
    check_err("8@%eip", 2, "unknown register %eip");
    check_err("8@%r16", 2, "unknown register %r16");
    check_err("8@(%rxx)", 3, "unknown register %rxx");
    check_err("8@%", 3, "register name");
    check_err("8@%-", 3, "register name");
}

#[test]
fn error_bad_size() {
    let e = check_err("3@%rax", 0, "size must be 1, 2, 4 or 8, found 3");
    assert_eq!(e.kind, ParseErrorKind::BadSize("3".into()));
    check_err("8@%rax -16@%rbx", 8, "found 16");
    check_err("0@%rax", 0, "found 0");
    check_err("99999999999999999999999@%rax", 0, "size must be");
}

#[test]
fn error_missing_operand() {
    check_err("8@", 2, "expected an operand");
    check_err("8@ 8@%rax", 2, "expected an operand");
    check_err("-4@@%eax", 3, "expected an operand");
    check_err("@%rax", 0, "expected an operand");
    check_err("8@!", 2, "found '!'");
}

#[test]
fn error_missing_at() {
    // `8%rax`: the 8 reads as an absolute address, then '%' is unexpected.
    check_err("8%rax", 1, "found '%'");
    check_err("-4%eax", 2, "found '%'");
}

#[test]
fn error_unterminated_parens() {
    check_err("8@-8(%rbp", 9, "expected ')'");
    check_err("8@-8(%rbp,%rax", 14, "expected ')'");
    check_err("8@-8(%rbp,%rax,8", 16, "expected ')'");
    check_err("8@-8(%rbp %rax", 9, "expected ')'");
    check_err("8@(", 3, "base register");
    check_err("8@()", 3, "base register");
    check_err("8@(%rax,)", 8, "expected a register");
    check_err("8@(%rax,%rbx,)", 13, "expected a scale");
}

#[test]
fn error_bad_scale() {
    let e = check_err("8@(%rax,%rbx,3)", 13, "scale must be 1, 2, 4 or 8, found 3");
    assert_eq!(e.kind, ParseErrorKind::BadScale("3".into()));
    check_err("8@(%rax,%rbx,16)", 13, "found 16");
    check_err("8@(%rax,%rbx,0)", 13, "found 0");
    check_err("8@(%rax,%rbx,x)", 13, "expected a scale");
}

#[test]
fn error_trailing_garbage() {
    check_err("8@%rax,", 6, "whitespace or end");
    check_err("8@%raxx", 2, "unknown register %raxx");
    check_err("8@-8(%rbp)x", 10, "whitespace or end");
    check_err("8@$5x", 4, "whitespace or end");
    check_err("8@12abc(%rax)", 4, "whitespace or end");
    check_err("8@(%rax))", 8, "found ')'");
}

#[test]
fn error_bad_numbers() {
    check_err("8@$", 3, "expected a number");
    check_err("8@$-", 4, "expected a number");
    check_err("8@$0x", 5, "hexadecimal digit");
    check_err("8@$0xg", 5, "hexadecimal digit");
    check_err("8@$18446744073709551616", 3, "does not fit in 64 bits");
    check_err("8@$0x10000000000000000", 3, "does not fit in 64 bits");
    check_err("8@foo+(%rip)", 6, "expected a number");
    check_err("8@foo+-4(%rip)", 6, "expected a number");
}

#[test]
fn error_bad_address_registers() {
    check_err("8@(%al)", 3, "%al cannot address memory");
    check_err("8@(%rax,%ax)", 8, "%ax cannot address memory");
    check_err("8@(%rax,%rsp,2)", 8, "%rsp cannot be an index register");
    check_err("8@(,%rip)", 4, "%rip cannot be an index register");
    check_err("8@16(%rip,%rax,2)", 10, "%rip-relative");
    check_err("8@(%rax,%ebx,2)", 8, "same width");
    check_err("8@(%eax,%rbx,2)", 8, "same width");
}

#[test]
fn error_non_ascii_is_reported_not_panicked() {
    let e = check_err("8@%r\u{e9}x", 2, "unknown register %r");
    assert!(matches!(e.kind, ParseErrorKind::UnknownRegister(_)));
    check_err("8@\u{1F600}", 2, "found '\u{1F600}'");
    check_err("\u{e9}", 0, "expected an operand");
}
