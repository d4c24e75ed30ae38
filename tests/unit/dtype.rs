use super::*;

#[test]
fn sums_in_element_arithmetic() {
    let mut a = bytemuck::cast_slice::<f32, u8>(&[1.0, 2.5]).to_vec();
    reduce_into(
        DType::F32,
        ReduceOp::Sum,
        &mut a,
        bytemuck::cast_slice(&[0.5f32, -1.0]),
    );
    assert_eq!(bytemuck::cast_slice::<u8, f32>(&a), &[1.5, 1.5]);
    let mut u = vec![200u8, 3];
    reduce_into(DType::U8, ReduceOp::Sum, &mut u, &[100, 4]);
    assert_eq!(u, vec![44, 7], "u8 sums wrap like ncclUint8");
    let mut m = vec![5u8, 3];
    reduce_into(DType::U8, ReduceOp::Max, &mut m, &[4, 9]);
    assert_eq!(m, vec![5, 9]);
    let mut h = bytemuck::cast_slice::<bf16, u8>(&[bf16::from_f32(256.0)]).to_vec();
    reduce_into(
        DType::BF16,
        ReduceOp::Sum,
        &mut h,
        bytemuck::cast_slice(&[bf16::from_f32(1.0)]),
    );
    // 257 is not representable in bf16: rounds to nearest even (256).
    assert_eq!(bytemuck::cast_slice::<u8, bf16>(&h)[0].to_f32(), 256.0);
    let mut v = bytemuck::cast_slice::<f32, u8>(&[6.0]).to_vec();
    divide(DType::F32, &mut v, 4);
    assert_eq!(bytemuck::cast_slice::<u8, f32>(&v), &[1.5]);
}
